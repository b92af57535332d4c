# throwaway: the parts of the evict's argument checks on the engine thread, inside bench_vllm
import sys, argparse, time, statistics, collections, threading
import numpy as np
import kvmove.mover as mv
T = collections.defaultdict(list)
flag = {"on": False}
def wrapf(mod, name):
    orig = getattr(mod, name)
    def w(*a, **k):
        if not flag["on"]:
            return orig(*a, **k)
        t0 = time.perf_counter(); r = orig(*a, **k); T[name].append((time.perf_counter() - t0) * 1e6); return r
    setattr(mod, name, w)
for n in ("check_keys", "as_index_tensor", "check_valid_tokens", "small_rows_ok"):
    wrapf(mv, n)
orig_tc = mv.KVMover._take_call
def tc(self, *a, gathering, **k):
    flag["on"] = gathering and threading.current_thread() is threading.main_thread()
    t0 = time.perf_counter(); r = orig_tc(self, *a, gathering=gathering, **k)
    if flag["on"]: T["_take_call(evict)"].append((time.perf_counter() - t0) * 1e6)
    flag["on"] = False
    return r
mv.KVMover._take_call = tc
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print("save returns kvmove %.3f ms vllm %.3f ms" % (res["median_s"]["kvmove save returns"] * 1e3, res["median_s"]["vLLM save returns"] * 1e3))
for k, v in T.items(): print(k, len(v), "median %.1f us" % statistics.median(v))
