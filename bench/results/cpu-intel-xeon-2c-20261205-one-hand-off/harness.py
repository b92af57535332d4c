# throwaway: the kernels bench harness (bench.timing.measure) with kvmove and the plain per-layer index_select only, then with the bulk copy too
import sys, torch, kvmove, statistics, time
sys.path.insert(0, ".")
from bench.workload import Workload
from bench.cases import Case
from bench import baselines
from bench.timing import measure
w = Workload(132, 1, 4096, 8, torch.device("cpu"), cache="per_layer")
tp, slots, _ = w.indices(4096)
case = Case("gather", 132, 1, 4096, 8)
prim, _ = baselines.primitive(w, case)
bulk, _ = baselines.bulk(w, case)[:2] if isinstance(baselines.bulk(w, case), tuple) else (baselines.bulk(w, case), None)
km = lambda: kvmove.gather(w.kv, w.staging, tp, slots, backend="torch")
for fns in ({"kvmove": km, "primitive": prim}, {"kvmove": km, "primitive": prim, "bulk": bulk}):
    t = measure(fns, device=torch.device("cpu"), warmup=1, repeats=9, min_sample_s=0.02, max_calls=20000)
    print({k: round(v.median * 1e6) for k, v in t.items()})
