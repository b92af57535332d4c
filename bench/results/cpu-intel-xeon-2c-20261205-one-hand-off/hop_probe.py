# throwaway: per native call, time from submit to start on the runner, and from return to the waiter resuming
import sys, time, argparse, statistics, threading, collections
from kvmove.store import bounded_call as bc
lat = collections.defaultdict(list)
orig_start = bc.start_call
def start_call(fn, *args, runner=None, on_return=None):
    t_sub = time.perf_counter(); marks = {}
    def w(*a):
        marks["start"] = time.perf_counter(); r = fn(*a); marks["ret"] = time.perf_counter(); return r
    w.__name__ = getattr(fn, "__name__", "?"); w.__self__ = getattr(fn, "__self__", None)
    sc = orig_start(w, *args, runner=runner, on_return=on_return)
    orig_outcome = sc.outcome
    class SC:
        future = sc.future; started = sc.started
        def outcome(self, timeout):
            o = orig_outcome(timeout); t = time.perf_counter()
            if "ret" in marks:
                lat[w.__name__].append(((marks["start"] - t_sub) * 1e3, (t - marks["ret"]) * 1e3, (marks["ret"] - marks["start"]) * 1e3))
            return o
    return SC()
bc.start_call = start_call
import kvmove.store.mooncake_store as ms
ms.start_call = start_call
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print({k: round(v, 3) for k, v in res.items() if k in ("save_ratio", "load_ratio")})
for k, v in lat.items():
    print(k, len(v), "to start med %.3f p90 %.3f | back med %.3f p90 %.3f | native med %.2f ms" % (
        statistics.median(x[0] for x in v), sorted(x[0] for x in v)[int(.9*len(v))],
        statistics.median(x[1] for x in v), sorted(x[1] for x in v)[int(.9*len(v))], statistics.median(x[2] for x in v)))
