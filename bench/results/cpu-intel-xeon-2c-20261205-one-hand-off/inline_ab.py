# throwaway: bench_vllm with the bounded-call hand-off on (as shipped) or off (calls inline)
import sys, argparse, statistics
from concurrent.futures import Future
import kvmove.store.bounded_call as bc
import kvmove.store.mooncake_store as ms
mode = sys.argv[1]
if mode == "inline":
    def submit(self, fn, *args):
        f = Future(); f.set_running_or_notify_cancel()
        try: f.set_result(fn(*args))
        except BaseException as e: f.set_exception(e)
        return f
    bc.CallRunner.submit = submit
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[2]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print(mode, "save %.3f load %.3f paired %s" % (res["save_ratio"], res["load_ratio"], {k: round(v["median"], 3) for k, v in res["paired_ratio"].items()}), "kvmove save ms %.2f vllm %.2f" % (res["median_s"]["kvmove save"]*1e3, res["median_s"]["vLLM save"]*1e3))
