import bench
import sys, time, statistics, numpy as np, torch, kvmove
from bench.workload import Workload
from kvmove.rows.plan import plan_whole_pages
rb, pt, pages, L = 132, 16, 4096, 4
w = Workload(rb, pt, pages, L, torch.device("cpu"), cache="stacked")
tp, slots, _ = w.indices(pages)
ub = rb * pt
kvu = [t.view(-1, ub) for t in w.kv_layers]; stu = [t.view(-1, ub)[:pages] for t in w.staging.tensor("kv").unbind(0)]
idx = tp[:, 0] // pt
def raw():
    for a, b in zip(kvu, stu): torch.index_select(a, 0, idx, out=b)
def plan_raw():
    p = plan_whole_pages(tp, slots, w.kv_layers[0].shape[0], pages, kv_is_src=True)
    ix = torch.from_numpy(p.pages[0])
    for a, b in zip(kvu, stu): torch.index_select(a, 0, ix, out=b)
def plan_only():
    plan_whole_pages(tp, slots, w.kv_layers[0].shape[0], pages, kv_is_src=True)
big = np.arange(65536)
def temps_raw():
    x = (big == big + 1).all()
    for a, b in zip(kvu, stu): torch.index_select(a, 0, idx, out=b)
km = lambda: kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")
def med(f, n=40):
    for _ in range(3): f()
    v = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    return statistics.median(v) * 1e6
for _ in range(3):
    print(" ".join("%s %.0f" % (k, med(f)) for k, f in [("raw", raw), ("plan_only", plan_only), ("plan+raw", plan_raw), ("temps+raw", temps_raw), ("kvmove", km)]))
