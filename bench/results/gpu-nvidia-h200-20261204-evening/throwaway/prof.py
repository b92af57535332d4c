import cProfile, pstats, time, torch, kvmove, io
from tests.gpu.common import build
kv = build([("kv", 61, 656, torch.uint8, 0)], 8192)
st = kvmove.StagingBuffer(kv, num_slots=64, page_tokens=1)
for where in ("cpu", "cuda"):
    pages = torch.arange(16).reshape(16, 1).to(where)
    slots = torch.arange(16).to(where)
    for check in (True, False):
        for _ in range(50): kvmove.gather(kv, st, pages, slots, backend="triton", check=check)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500): kvmove.gather(kv, st, pages, slots, backend="triton", check=check)
        dt = (time.perf_counter() - t) / 500 * 1e6
        torch.cuda.synchronize()
        pr = cProfile.Profile(); pr.enable()
        for _ in range(300): kvmove.gather(kv, st, pages, slots, backend="triton", check=check)
        pr.disable(); torch.cuda.synchronize()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        print(f"==== indices on {where}, check={check}: {dt:.1f} us/call")
        print(s.getvalue()[-4500:])
