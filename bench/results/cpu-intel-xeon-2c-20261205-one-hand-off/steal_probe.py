# throwaway: in bench_vllm's in-place load, which thread runs the mover's job: the waiting
# caller (steal: one hand-off, to the store's runner) or an executor worker (two)
import sys, argparse, threading, collections
import kvmove.transfer as tr
who = collections.Counter()
orig_execute = tr.StealableJob._execute
def _execute(self):
    who["caller" if threading.current_thread() is threading.main_thread() else "worker"] += 1
    return orig_execute(self)
tr.StealableJob._execute = _execute
import bench.bench_vllm as bv
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]), warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print("ran by", dict(who), "load ratio %.3f paired %.3f" % (res["load_ratio"], res["paired_ratio"]["load"]["median"]), "save ratio %.3f paired %.3f" % (res["save_ratio"], res["paired_ratio"]["save"]["median"]))
