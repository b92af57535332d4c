# throwaway: where the engine thread's time in the connector's evict (save) goes, inside bench_vllm
import sys, argparse, time, statistics, collections, threading
import kvmove.mover as mv
T = collections.defaultdict(list)
def timed(cls, name):
    orig = getattr(cls, name)
    def w(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            return orig(*a, **k)
        t0 = time.perf_counter(); r = orig(*a, **k); T[name].append((time.perf_counter() - t0) * 1e6); return r
    setattr(cls, name, w)
for n in ("evict", "_take_call", "_submit", "_evict_in_place"):
    timed(mv.KVMover, n)
import kvmove.integrations.vllm.worker as wk
orig_bp = wk.block_pages
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print("save returns kvmove %.3f ms vllm %.3f ms" % (res["median_s"]["kvmove save returns"] * 1e3, res["median_s"]["vLLM save returns"] * 1e3))
for k, v in T.items(): print(k, len(v), "median %.1f us" % statistics.median(v))
