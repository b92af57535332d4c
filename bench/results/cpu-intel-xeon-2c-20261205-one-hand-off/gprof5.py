# throwaway: kvmove gather (forced onto index_select with KVMOVE_FORCE_SELECT=1 GATHER_LINE=135) vs the plain per-layer index_select, back to back, and a profile of the kvmove call
import force_select, sys, time, statistics, torch, kvmove, cProfile, pstats
sys.path.insert(0, ".")
from bench.workload import Workload
from bench.cases import Case
from bench import baselines
cache, rb, pt, pages, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
w = Workload(rb, pt, pages, L, torch.device("cpu"), cache=cache)
tp, slots, rows = w.indices(pages)
km = lambda: kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")
prim, _ = baselines.primitive(w, Case("gather", rb, pt, pages, L))
for f in (km, prim):
    for _ in range(20): f()
    v = []
    for _ in range(200):
        t0 = time.perf_counter(); f(); v.append(time.perf_counter() - t0)
    print("median us %.1f" % (statistics.median(v) * 1e6))
cProfile.run("for _ in range(300): km()", "/tmp/gp5")
pstats.Stats("/tmp/gp5").sort_stats("tottime").print_stats(16)
