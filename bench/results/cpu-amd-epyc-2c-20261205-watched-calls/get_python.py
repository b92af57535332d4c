# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-watched-calls/get_python.py
# kvmove's Python around the native get, the native call faked (returns the sizes at once):
# store.get with the runner hand-off, store.get(until_returned=True), and a whole in-place
# prefetch run by its caller; hot, and cold (after a 32 MiB copy)
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, sys
import numpy as np
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
size = L * 8 * bs * 128 * 2
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
    assert mover.evict(k, block_pages(save_ids), detect_exists=False).wait() == [kvmove.Status.OK] * n
    desc = mover._prefetch_rows.describe_trusted(np.array(load_ids, dtype=np.int64).reshape(-1, 1), k, np.full(n, 1, dtype=np.int64), get=True)
    real = store._client
    class Fake:
        def __getattr__(self, name): return getattr(real, name)
        def batch_get_into_multi_buffers(self, keys, ptrs, sizes): return [size] * len(keys)
    fake = Fake()
    store._client = store._state.client = fake
    store._budgets[id(fake)] = store._budgets[id(real)]; store._state.users[id(fake)] = 0
    def prefetch():
        t = mover.prefetch(k, block_pages(load_ids)); assert t.wait() == [kvmove.Status.OK] * n
    fns = {"get": lambda: store.get(desc), "get watched": lambda: store.get(desc, until_returned=True),
           "prefetch (steal)": prefetch}
    for cold in (False, True):
        rows = {x: [] for x in fns}
        for r in range(100):
            for name, f in fns.items():
                if cold: b.copy_(a)
                t0 = time.perf_counter(); f(); rows[name].append(time.perf_counter() - t0)
        print(("cold " if cold else "hot  ") + "  ".join(f"{x} {statistics.median(v[5:])*1e6:.0f} us" for x, v in rows.items()))
    store._client = store._state.client = real
    mover.close()
