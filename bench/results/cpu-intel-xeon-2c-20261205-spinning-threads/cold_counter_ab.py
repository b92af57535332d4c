# throwaway: a checked kvmove.gather (torch backend) after a 32 MiB copy (cold caches), with
# the error counter made by torch.zeros ("old") and taken from the pool of views ("new"),
# alternating, and the plain per-layer index_select; paired difference. From the repository
# root: OMP_WAIT_POLICY=default PYTHONPATH=. python <this folder>/cold_counter_ab.py 656 1 16 8 per_layer
import bench
import sys, time, statistics, numpy as np, torch, kvmove
from bench.workload import Workload
from kvmove.rows import moves
rb, pt, pages, L = map(int, sys.argv[1:5]); cache = sys.argv[5]
w = Workload(rb, pt, pages, L, torch.device("cpu"), cache=cache)
tp, slots, rows = w.indices(pages)
big_a = torch.empty(32 << 20, dtype=torch.uint8); big_b = torch.empty(32 << 20, dtype=torch.uint8)
def pollute(): big_b.copy_(big_a)
new = moves.new_error_counter
old = lambda device: torch.zeros(1, dtype=torch.int32, device=device)
kvl = [t.view(-1, rb) for t in w.kv_layers]; stl = [t.view(-1, rb)[:len(rows)] for t in w.staging.tensor("kv").unbind(0)]
def prim():
    for a, b in zip(kvl, stl): torch.index_select(a, 0, rows, out=b)
def A(): moves.new_error_counter = old; pollute(); t0 = time.perf_counter(); kvmove.gather(w.kv, w.staging, tp, slots, backend="torch"); return time.perf_counter() - t0
def B(): moves.new_error_counter = new; pollute(); t0 = time.perf_counter(); kvmove.gather(w.kv, w.staging, tp, slots, backend="torch"); return time.perf_counter() - t0
def P(): pollute(); t0 = time.perf_counter(); prim(); return time.perf_counter() - t0
res = {"old": [], "new": [], "prim": []}
for r in range(int(sys.argv[6]) if len(sys.argv) > 6 else 150):
    res["old"].append(A()); res["new"].append(B()); res["prim"].append(P())
m = {k: statistics.median(v[10:]) * 1e6 for k, v in res.items()}
d = [a - b for a, b in zip(res["old"][10:], res["new"][10:])]
print(cache, rb, pt, pages, L, " ".join("%s=%.1f" % kv for kv in m.items()), "paired old-new median %.1f us" % (statistics.median(d) * 1e6))
