# throwaway: KVMover.prefetch return time split (_take_call, Transfer, _submit) on the hot-path bench shape; argv: cache, calls, seconds of sleep between calls (0, 0.001, 0.01)
import sys, time, statistics, os, torch, kvmove
from bench.bench_hot_path import kv_cache
import kvmove.mover as mv
T = {}
def timed(obj, name):
    orig = getattr(obj, name)
    def w(*a, **k):
        t0 = time.perf_counter(); r = orig(*a, **k); T.setdefault(name, []).append((time.perf_counter() - t0) * 1e6); return r
    setattr(obj, name, w)
timed(mv.KVMover, "_take_call"); timed(mv.KVMover, "_submit")
orig_init = mv.Transfer.__init__
def ti(self, *a, **k):
    t0 = time.perf_counter(); orig_init(self, *a, **k); T.setdefault("Transfer", []).append((time.perf_counter() - t0) * 1e6)
mv.Transfer.__init__ = ti
cache = sys.argv[1]
with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
    kv = kv_cache(cache, 61, 1024, 656, torch.device("cpu"))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="hot") as mover:
        keys = [f"hot-{os.getpid()}-{i}" for i in range(32)]
        mover.evict(keys, torch.arange(32).reshape(-1, 1)).wait(60)
        dest = torch.arange(512, 544).reshape(-1, 1)
        ret = []
        for i in range(int(sys.argv[2])):
            t0 = time.perf_counter(); t = mover.prefetch(keys, dest); ret.append((time.perf_counter() - t0) * 1e6)
            t.wait(); t.scattered.synchronize(); time.sleep(float(sys.argv[3]))
            if i == 5: T.clear(); ret.clear()
        print(cache, "return med %.1f" % statistics.median(ret), {k: "%.1f" % statistics.median(v) for k, v in T.items()})
        print("  max", "%.0f" % max(ret), {k: "%.0f" % max(v) for k, v in T.items()})
