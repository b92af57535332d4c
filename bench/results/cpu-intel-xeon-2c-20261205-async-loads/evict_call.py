# throwaway: PYTHONPATH=<checkout> .venv/bin/python bench/results/cpu-intel-xeon-2c-20261205-async-loads/evict_call.py, run from the checkout (before: a worktree of 1927e3f)
# evict() return time of one page, 8 layers x 656 B rows, 16-token pages, stacked and per-layer
# caches, in-memory store (tests/support/memory_store.py): the mover's own per-call cost
import bench  # noqa
import statistics, time, torch, kvmove, uuid, sys
from tests.support.memory_store import MemoryStore
res = {}
for cache in ("stacked", "per_layer"):
    if cache == "stacked":
        kv = kvmove.KVCache({"kv": torch.zeros(8, 4096, 656, dtype=torch.uint8)})
    else:
        kv = kvmove.KVCache({"kv": [torch.zeros(4096, 656, dtype=torch.uint8) for _ in range(8)]})
    store = MemoryStore()
    m = kvmove.KVMover(kv, store, page_tokens=16, staging_slots=64, path="staged")
    pages = torch.arange(16).reshape(1, 16)
    v = []
    for r in range(400):
        k = [uuid.uuid4().hex]
        t0 = time.perf_counter(); t = m.evict(k, pages); v.append(time.perf_counter() - t0)
        t.wait()
    m.close()
    res[cache] = statistics.median(v[50:]) * 1e6
print(" ".join(f"{c} {u:.1f} µs" for c, u in res.items()))
