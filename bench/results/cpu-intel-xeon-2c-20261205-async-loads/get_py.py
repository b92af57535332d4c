# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-intel-xeon-2c-20261205-async-loads/get_py.py
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, numpy as np
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
import kvmove.store.mooncake_store as MS
from kvmove.store.bounded_call import StartedCall
from concurrent.futures import Future
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
a = torch.empty(32 << 20, dtype=torch.uint8); b = torch.empty_like(a)
class Fake:
    def __init__(self, real, sizes): self._real, self._sizes = real, sizes
    def __getattr__(self, name): return getattr(self._real, name)
    def batch_get_into_multi_buffers(self, keys, ptrs, sizes): return list(self._sizes)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
    desc = mover._prefetch_rows.describe_trusted(np.array(load_ids, dtype=np.int64).reshape(-1, 1), k,
                                  np.full(n, 1, dtype=np.int64), get=True)
    from tests.support.store_state import swap_client
    fake = swap_client(store, lambda real: Fake(real, desc.object_sizes()))
    for label, cool in (("cold", True), ("hot", False)):
        v = []
        for r in range(60):
            if cool: b.copy_(a)
            t0 = time.perf_counter(); st = store.get(desc); v.append(time.perf_counter() - t0)
        assert all(s is kvmove.Status.OK for s in st)
        print(f"store.get Python (native call faked), {label}: median {statistics.median(v[5:])*1e6:.0f} µs")
    real = MS.start_call
    def inline_start(fn, *args, runner=None, on_return=None):
        f = Future(); f.set_result(fn(*args))
        if on_return is not None: on_return()
        return StartedCall(f, time.monotonic())
    MS.start_call = inline_start
    for label, cool in (("cold", True), ("hot", False)):
        v = []
        for r in range(60):
            if cool: b.copy_(a)
            t0 = time.perf_counter(); st = store.get(desc); v.append(time.perf_counter() - t0)
        print(f"  the same without the runner hop, {label}: median {statistics.median(v[5:])*1e6:.0f} µs")
    MS.start_call = real
    mover.close()
