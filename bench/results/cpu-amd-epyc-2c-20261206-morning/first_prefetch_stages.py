"""Throwaway: where the first prefetches of a fresh KVMover (path staged; after one evict) spend their time, by stage, against the next ones (µs; same shape)."""
import time, torch, kvmove, functools, sys
from bench.bench_hot_path import kv_cache
acc = []
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: acc.append((name, round((time.perf_counter()-t0)*1e6)))
    setattr(obj, name, g)
with kvmove.MooncakeStore.embedded() as store:
    kv = kv_cache("stacked", 61, 1024, 656, torch.device("cpu"))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="p") as m:
        keys = [f"k{i}" for i in range(32)]
        if len(sys.argv) > 1:
            assert m.evict(keys, torch.arange(32).reshape(-1, 1)).wait(60) == [kvmove.Status.OK] * 32
        for n in ("_take_call", "_start", "_get_job", "_scatter"): wrap(m, n)
        wrap(store, "get")
        dest = torch.arange(512, 544).reshape(-1, 1)
        if len(sys.argv) == 1:
            t0=time.perf_counter(); t=m.evict(keys, torch.arange(32).reshape(-1, 1)); r=time.perf_counter()-t0; t.wait(); print("first evict return", round(r*1e6), acc); acc.clear()
        for i in range(3):
            t0 = time.perf_counter(); t = m.prefetch(keys, dest); r = time.perf_counter() - t0
            t.wait(); d = time.perf_counter() - t0
            print(f"prefetch {i}: return {r*1e6:.0f} done {d*1e6:.0f}", acc); acc.clear()
