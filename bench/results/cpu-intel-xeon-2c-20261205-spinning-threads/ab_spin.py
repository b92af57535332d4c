# throwaway: kvmove.gather (torch backend) with the previous copy choices for spinning OpenMP
# threads ("old": numpy up to 128 KiB a layer, one index_select of a stacked cache up to
# 4 MiB) against the new ones (64 KiB, 512 KiB) and the plain per-layer index_select, each
# timed back to back (25 calls, median), the three interleaved, 3 rounds (min of medians).
# From the repository root: OMP_WAIT_POLICY=default python <this folder>/ab_spin.py
import itertools, statistics, sys, time
sys.path.insert(0, ".")
import bench  # first: it applies OMP_WAIT_POLICY before torch loads OpenMP
import torch
import kvmove
from bench import baselines
from bench.cases import Case
from bench.workload import Workload
from kvmove.rows import host_copy, torch_backend

def med(f, n=25):
    for _ in range(5): f()
    v = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    return statistics.median(v) * 1e6

def choices(old):
    host_copy.SPINNING_THREADS_MAX_BYTES = (128 if old else 64) << 10
    torch_backend.SPINNING_STACKED_SELECT_MAX_BYTES = (4 << 20) if old else (512 << 10)

print("threads spin:", host_copy.threads_spin(), "torch threads:", torch.get_num_threads())
L = 8
rows = []
for cache, (rb, pt, pages) in itertools.product(("stacked", "per_layer"), [
        (132, 1, 256), (132, 1, 1024), (132, 16, 64), (656, 1, 256), (656, 16, 16),
        (656, 16, 64), (1152, 1, 256), (4096, 1, 64), (4096, 1, 256), (132, 16, 256)]):
    w = Workload(rb, pt, pages, L, torch.device("cpu"), cache=cache)
    tp, slots, _ = w.indices(pages)
    prim, _ = baselines.primitive(w, Case("gather", rb, pt, pages, L))
    def km(): kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")
    def old(): choices(True); km()
    t = {"old": [], "new": [], "prim": []}
    for _ in range(3):
        choices(True); t["old"].append(med(km))
        choices(False); t["new"].append(med(km))
        t["prim"].append(med(prim))
    t = {k: min(v) for k, v in t.items()}
    rows.append((cache, rb, pt, pages, t))
    print(f"{cache:9s} {rb:5d} x {pt:2d} x {pages:5d} ({rb * pt * pages * L >> 10:6d} KiB): "
          f"old {t['old']:6.0f} new {t['new']:6.0f} primitive {t['prim']:6.0f} us   "
          f"old/new {t['old'] / t['new']:.2f}  primitive/new {t['prim'] / t['new']:.2f}",
          flush=True)
    w.close()
print("old/new median %.2f, min %.2f, max %.2f" % (
    statistics.median(r[4]["old"] / r[4]["new"] for r in rows),
    min(r[4]["old"] / r[4]["new"] for r in rows), max(r[4]["old"] / r[4]["new"] for r in rows)))
