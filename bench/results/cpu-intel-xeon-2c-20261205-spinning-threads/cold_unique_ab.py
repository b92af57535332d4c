# throwaway: a checked kvmove.gather (torch backend) after a 32 MiB copy (cold caches), with
# the uniqueness check of a small plan made by numpy ("old") and on its list ("new"),
# alternating; paired difference. From the repository root:
# OMP_WAIT_POLICY=default PYTHONPATH=. python <this folder>/cold_unique_ab.py 656 1 16 8 per_layer
import bench
import sys, time, statistics, numpy as np, torch, kvmove
from bench.workload import Workload
from kvmove.rows import moves
from kvmove import checks
rb, pt, pages, L = map(int, sys.argv[1:5]); cache = sys.argv[5]
w = Workload(rb, pt, pages, L, torch.device("cpu"), cache=cache)
tp, slots, rows = w.indices(pages)
big_a = torch.empty(32 << 20, dtype=torch.uint8); big_b = torch.empty(32 << 20, dtype=torch.uint8)
def pollute(): big_b.copy_(big_a)
cu = moves.check_unique
def old_cu(rows, name, page_tokens=1):
    if isinstance(rows, list): rows = np.array(rows, dtype=np.int64)
    return cu(rows, name, page_tokens=page_tokens)
def run(variant):
    moves.check_unique = old_cu if variant == "old" else cu
    pollute(); t0 = time.perf_counter(); kvmove.gather(w.kv, w.staging, tp, slots, backend="torch"); return time.perf_counter() - t0
res = {"old": [], "new": []}
for r in range(150):
    for v in ("old", "new"): res[v].append(run(v))
d = [a - b for a, b in zip(res["old"][10:], res["new"][10:])]
print(cache, rb, pt, pages, L, " ".join("%s=%.1f" % (k, statistics.median(v[10:]) * 1e6) for k, v in res.items()), "paired old-new median %.1f us" % (statistics.median(d) * 1e6))
