# throwaway: kvmove.gather (torch backend) against the plain per-layer index_select of the
# rows and the raw copies it could make (numpy take on this thread, per-layer index_select of
# page units in bytes and in wide words), each timed back to back (30 calls, median), 8
# layers. argv: "late" imports bench (which sets OMP_WAIT_POLICY=PASSIVE by default) after
# torch and kvmove, as ../cpu-intel-xeon-2c-20261205-one-hand-off/alone.py did; anything
# else imports it first.
# From the repository root: [OMP_WAIT_POLICY=default] PYTHONPATH=. python <this>/back_to_back.py [late]
import sys
if sys.argv[1:] != ["late"]:
    import bench  # noqa: F401
import os, time, statistics
import numpy as np, torch, kvmove
from bench.workload import Workload
from bench.cases import Case
from bench import baselines
from kvmove.rows import host_copy
from kvmove.rows.plan import unit_tokens
def med(f, n=30):
    for _ in range(5): f()
    v = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    return statistics.median(v) * 1e6
L = 8
print("OMP_WAIT_POLICY now:", os.environ.get("OMP_WAIT_POLICY"), " kvmove reads threads as spinning:", host_copy.threads_spin())
ratios = []
for cache in ("per_layer", "stacked"):
  for rb, pt, pages in [(656,1,256),(132,1,4096),(132,16,256),(656,16,256),(4096,1,256),(656,1,4096),(1152,64,64),(132,64,256)]:
    w = Workload(rb, pt, pages, L, torch.device("cpu"), cache=cache)
    tp, slots, rows = w.indices(pages)
    case = Case("gather", rb, pt, pages, L)
    unit = unit_tokens(pt, rb); ub = unit * rb
    units = ((tp[:, 0] // unit)[:, None] + torch.arange(pt // unit)).reshape(-1)
    n = len(units)
    kvu = [w.kv_layer(l).view(-1, ub) for l in range(L)]
    stu = [w.staging_layer(l).view(-1, ub)[:n] for l in range(L)]
    kvn = [k.numpy() for k in kvu]; stn = [s.numpy() for s in stu]; un = units.numpy()
    wide = torch.int64 if ub % 8 == 0 else (torch.int32 if ub % 4 == 0 else torch.uint8)
    kvw = [k.view(wide) for k in kvu]; stw = [s.view(wide) for s in stu]
    def km(): kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")
    prim, _ = baselines.primitive(w, case)
    def np1():
        for a, b in zip(kvn, stn): np.take(a, un, axis=0, out=b, mode="clip")
    def selb():
        for a, b in zip(kvu, stu): torch.index_select(a, 0, units, out=b)
    def selw():
        for a, b in zip(kvw, stw): torch.index_select(a, 0, units, out=b)
    res = {k: [] for k in ("kvmove", "primitive", "numpy", "units_u8", "units_wide")}
    for _ in range(2):
        for k, f in zip(res, (km, prim, np1, selb, selw)): res[k].append(med(f))
    res = {k: min(v) for k, v in res.items()}
    ratios.append(res["primitive"] / res["kvmove"])
    print(f"{cache:9s} {rb:4d} x {pt:2d} x {pages:4d}: " + " ".join(f"{k} {v:5.0f}" for k, v in res.items()) + f" us   primitive/kvmove {ratios[-1]:.2f}", flush=True)
    w.close()
print("primitive/kvmove: worst %.2f, median %.2f" % (min(ratios), statistics.median(ratios)))
