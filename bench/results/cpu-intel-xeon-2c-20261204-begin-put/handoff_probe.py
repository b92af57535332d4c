# throwaway: submit->start latency of runner calls inside bench_vllm, and thread starts
import sys, time, argparse, statistics, threading, collections
from kvmove.store import bounded_call as bc
import kvmove.store.mooncake_store as ms
lat = collections.defaultdict(list); starts = [0]
orig_submit = bc.CallRunner.submit
def submit(self, fn, *args):
    t0 = time.perf_counter(); name = getattr(fn, "__name__", "?")
    def w(*a):
        lat[name].append((time.perf_counter() - t0) * 1e3); return fn(*a)
    with self._lock:
        if self._idle == 0: starts[0] += 1
    return orig_submit(self, w, *args)
bc.CallRunner.submit = submit
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print({k: round(v, 3) for k, v in res.items() if k in ("save_ratio", "load_ratio")}, "thread starts", starts[0])
for k, v in lat.items():
    v = sorted(v); print(k, len(v), "median %.3f p90 %.3f max %.3f" % (statistics.median(v), v[int(0.9 * len(v))], v[-1]), [round(x, 2) for x in v[-6:]])
