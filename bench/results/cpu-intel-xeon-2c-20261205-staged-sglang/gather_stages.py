# throwaway: kvmove.gather (torch backend) taken apart, medians of 1000 calls back to back:
# the whole call, each step on its own, a reused plan's run, a fresh plan and its run.
# argv: row_bytes page_tokens pages per_layer|stacked.
# OMP_WAIT_POLICY=default PYTHONPATH=. python <this> 656 1 256 per_layer
import sys
import bench  # noqa
import time, statistics, torch, kvmove
from bench.workload import Workload
from kvmove.rows import moves, plan as planm, torch_backend as tb
from kvmove.rows.prepared import prepared_copy
from kvmove.checks import check_unique
rb, pt, pages, cache = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
w = Workload(rb, pt, pages, 8, torch.device("cpu"), cache=cache)
tp, slots, rows = w.indices(pages)
kv, st = w.kv, w.staging
def med(fn, n=1000):
    v = []
    for _ in range(n):
        t0 = time.perf_counter_ns(); fn(); v.append(time.perf_counter_ns() - t0)
    return statistics.median(v) / 1e3
pc = prepared_copy(kv.row_pool, st.row_pool, backend="torch", direction="gather", page_tokens=st.page_tokens)
t, s = moves._page_indices(pc, tp, slots)
e = moves.error_counter(None, pc.device)
pl = moves.plan_pages(pc, t, s, check=True)
steps = {
 "full": lambda: kvmove.gather(kv, st, tp, slots, backend="torch"),
 "check_pools": lambda: moves._check_pools(kv, st),
 "prepared_copy": lambda: prepared_copy(kv.row_pool, st.row_pool, backend="torch", direction="gather", page_tokens=st.page_tokens),
 "page_indices": lambda: moves._page_indices(pc, tp, slots),
 "error_counter": lambda: moves.error_counter(None, pc.device),
 "plan_whole_pages": lambda: planm.plan_whole_pages(t, s, pc.kv_rows, pc.staging_slots, kv_is_src=True),
 "check_unique": lambda: check_unique(s.numpy(), "slots", page_tokens=1),
 "plan_pages": lambda: moves.plan_pages(pc, t, s, check=True),
 "run_pages(reused plan)": lambda: moves.run_pages(pc, pl, e),
 "fresh plan+run": lambda: moves.run_pages(pc, moves.plan_pages(pc, t, s, check=True), e),
}
for r in range(2):
    print(" | ".join(f"{k} {med(f):5.1f}" for k, f in steps.items()))
from kvmove.memory.row_pool import shared_wide_type


import gc
gc.disable()
print("gc off:", " | ".join(f"{k} {med(f):5.1f}" for k, f in steps.items() if k in ("full", "run_pages(reused plan)", "fresh plan+run", "plan_pages")))
gc.enable()
print("gc on: ", " | ".join(f"{k} {med(f):5.1f}" for k, f in steps.items() if k in ("full", "run_pages(reused plan)", "fresh plan+run", "plan_pages")))
part = pl.plan.units(1)
def clear_t():
    part._tensors.clear(); moves.run_pages(pc, pl, e)
def clear_runs():
    part._runs.clear(); moves.run_pages(pc, pl, e)
def clear_moves():
    part.moves.clear(); moves.run_pages(pc, pl, e)
def clear_all():
    part._tensors.clear(); part._runs.clear(); part.moves.clear(); moves.run_pages(pc, pl, e)
import numpy as np
vals = part._sides["src"]
def clear_newarr():
    part._sides["src"] = vals.copy(); part._tensors.clear(); moves.run_pages(pc, pl, e)
for f in (clear_t, clear_runs, clear_moves, clear_all, clear_newarr):
    print(f.__name__, f"{med(f):5.1f}")
