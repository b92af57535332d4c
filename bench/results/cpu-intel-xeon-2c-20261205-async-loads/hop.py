# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-intel-xeon-2c-20261205-async-loads/hop.py
# the store's bounded call (native call on a runner thread) against the same native call made
# on the calling thread, same descriptors; bench_vllm geometry (256 blocks x 16 regions)
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
a = torch.empty(32 << 20, dtype=torch.uint8); b = torch.empty_like(a)
rows = {"store.get (runner thread)": [], "native call inline": [], "ratio": []}
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
    assert mover.evict(k, block_pages(save_ids), detect_exists=False).wait() == [kvmove.Status.OK] * n
    rows_ = mover._prefetch_rows
    import numpy as np
    desc = rows_.describe_trusted(np.array(load_ids, dtype=np.int64).reshape(-1, 1), k,
                                  np.full(n, 1, dtype=np.int64), get=True)
    client = store._client
    ptrs, sizes = [list(p) for p in desc.ptrs], [list(s) for s in desc.sizes]
    def via_store():
        st = store.get(desc); assert all(s is kvmove.Status.OK for s in st)
    def inline():
        res = client.batch_get_into_multi_buffers(k, ptrs, sizes)
        assert all(r > 0 for r in res)
    for r in range(40):
        pair = {}
        order = [("store.get (runner thread)", via_store), ("native call inline", inline)]
        if r % 2: order.reverse()
        for name, f in order:
            b.copy_(a)
            t0 = time.perf_counter(); f(); pair[name] = time.perf_counter() - t0
        if r >= 4:
            for name, v in pair.items(): rows[name].append(v)
            rows["ratio"].append(pair["store.get (runner thread)"] / pair["native call inline"])
    mover.close()
for name, v in rows.items():
    if name == "ratio":
        q = statistics.quantiles(v, n=4)
        print(f"paired ratio store/inline: median {statistics.median(v):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
    else:
        print(f"{name:28s} median {statistics.median(v)*1e3:.3f} ms  min {min(v)*1e3:.3f}")
d = [a_ - b_ for a_, b_ in zip(rows["store.get (runner thread)"], rows["native call inline"])]
print(f"difference per call: median {statistics.median(d)*1e3:.3f} ms")

# the same with the store's runner hop replaced by an inline call
import kvmove.store.mooncake_store as MS
from kvmove.store.bounded_call import StartedCall
from concurrent.futures import Future
def inline_start(fn, *args, runner=None, on_return=None):
    f = Future()
    try:
        f.set_result(fn(*args))
    except BaseException as e:
        f.set_exception(e)
    if on_return is not None:
        on_return()
    return StartedCall(f, time.monotonic())
rows = {"store.get, runner hop": [], "store.get, inline": [], "native": []}
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
    assert mover.evict(k, block_pages(save_ids), detect_exists=False).wait() == [kvmove.Status.OK] * n
    desc = mover._prefetch_rows.describe_trusted(np.array(load_ids, dtype=np.int64).reshape(-1, 1), k,
                                  np.full(n, 1, dtype=np.int64), get=True)
    client = store._client
    ptrs, sizes = [list(p) for p in desc.ptrs], [list(s) for s in desc.sizes]
    real = MS.start_call
    def hop():
        MS.start_call = real; st = store.get(desc); assert all(s is kvmove.Status.OK for s in st)
    def noho():
        MS.start_call = inline_start; st = store.get(desc); MS.start_call = real
        assert all(s is kvmove.Status.OK for s in st)
    def native():
        res = client.batch_get_into_multi_buffers(k, ptrs, sizes); assert all(r > 0 for r in res)
    fns = list(zip(rows, (hop, noho, native)))
    for r in range(45):
        pair = {}
        for name, f in fns[r % 3:] + fns[:r % 3]:
            b.copy_(a)
            t0 = time.perf_counter(); f(); pair[name] = time.perf_counter() - t0
        if r >= 6:
            for name, v in pair.items(): rows[name].append(v)
    mover.close()
for name, v in rows.items():
    d = [x - y for x, y in zip(v, rows["native"])]
    print(f"{name:24s} median {statistics.median(v)*1e3:.3f} ms; over native, paired: median {statistics.median(d)*1e3:.3f} ms")
