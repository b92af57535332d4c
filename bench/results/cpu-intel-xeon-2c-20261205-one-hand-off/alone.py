# throwaway: kvmove's torch-backend gather/scatter against the plain per-layer torch op, each
# method alone (back to back, 30 calls) and in rotation, under this process's OMP_WAIT_POLICY
import sys, os, time, statistics, itertools
import force_select, torch, kvmove
sys.path.insert(0, ".")
from bench.workload import Workload
from bench.cases import Case
from bench import baselines
def med(f, n=30):
    for _ in range(5): f()
    v = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    return statistics.median(v)
rows = []
for cache, rb, pt, pages in itertools.product(("per_layer", "stacked"), (132, 656, 4096), (1, 16), (256, 4096)):
    if d_only := os.environ.get("DIRS"): pass
    if rb * pt * pages * 8 > (64 << 20): continue
    w = Workload(rb, pt, pages, 8, torch.device("cpu"), cache=cache)
    tp, slots, _ = w.indices(pages)
    for d in os.environ.get("DIRS", "gather scatter").split():
        case = Case(d, rb, pt, pages, 8)
        km = (lambda: kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")) if d == "gather" else (lambda: kvmove.scatter(w.staging, slots, w.kv, tp, backend="torch"))
        prim, _ = baselines.primitive(w, case)
        a_k, a_p = med(km), med(prim)
        rows.append((cache, rb, pt, pages, d, a_p / a_k, a_k * 1e6, a_p * 1e6))
    w.close()
print("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY"))
for r in rows: print(*r[:5], "alone: primitive/kvmove %.2f  (kvmove %.0f us, primitive %.0f us)" % r[5:])
print("worst", min(r[5] for r in rows), "median", statistics.median(r[5] for r in rows))
