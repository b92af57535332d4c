# throwaway: the pieces of a kvmove.gather call each timed after a 32 MiB copy (cold caches,
# as between an engine's own work), medians of 300. argv as gather_stages.py.
# OMP_WAIT_POLICY=default PYTHONPATH=. python <this> 656 1 256 per_layer
import sys
import bench  # noqa
import time, statistics, torch, kvmove
from bench.workload import Workload
from kvmove.rows import moves
from kvmove.rows.prepared import prepared_copy
from kvmove.rows.error_counters import new_error_counter
from kvmove.checks import as_index_tensor
rb, pt, pages, cache = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
w = Workload(rb, pt, pages, 8, torch.device("cpu"), cache=cache)
tp, slots, rows = w.indices(pages)
kv, st = w.kv, w.staging
big_a = torch.empty(32 << 20, dtype=torch.uint8); big_b = torch.empty_like(big_a)
pc = prepared_copy(kv.row_pool, st.row_pool, backend="torch", direction="gather", page_tokens=st.page_tokens)
t, s = moves._page_indices(pc, tp, slots)
e = moves.error_counter(None, pc.device)
cpu = torch.device("cpu")
pl = moves.plan_pages(pc, t, s, check=True)
steps = {
 "check_pools": lambda: moves._check_pools(kv, st),
 "prepared_copy": lambda: prepared_copy(kv.row_pool, st.row_pool, backend="torch", direction="gather", page_tokens=st.page_tokens),
 "page_indices": lambda: moves._page_indices(pc, tp, slots),
 "as_index_tensor": lambda: as_index_tensor(tp, "x", dim=2, device=cpu),
 "error_counter": lambda: moves.error_counter(None, cpu),
 "new_error_counter": lambda: new_error_counter(cpu),
 "tp.numpy": lambda: tp.numpy(),
 "shape": lambda: tp.shape[0],
 "run_reused": lambda: moves.run_pages(pc, pl, e),
 "noop": lambda: None,
}
res = {k: [] for k in steps}
for r in range(300):
    for k, f in steps.items():
        big_b.copy_(big_a)
        t0 = time.perf_counter_ns(); f(); res[k].append(time.perf_counter_ns() - t0)
print(" | ".join(f"{k} {statistics.median(v)/1e3:5.1f}" for k, v in res.items()))
