# throwaway: bench_sglang's end-to-end layer_first 32x16 with each side's native Mooncake calls timed
import sys, time, statistics, os
import bench.bench_sglang as bs
import kvmove
rec = []
class Timed:
    def __init__(self, real, who): self.real, self.who = real, who
    def __getattr__(self, k):
        v = getattr(self.real, k)
        if not k.startswith("batch_"): return v
        def w(*a, **kw):
            t0 = time.perf_counter(); r = v(*a, **kw); rec.append((self.who, k, (time.perf_counter() - t0) * 1e3)); return r
        w.__name__ = k
        return w
orig = bs.make_backends
def make(model, pf):
    s, o = orig(model, pf)
    s.store = Timed(s.store, "sglang")
    c = o.store._client; t = Timed(c, "kvmove")
    o.store._budgets[id(t)] = o.store._budgets[id(c)]; o.store._client = o.store._state.client = t
    return s, o
bs.make_backends = make
import argparse
args = argparse.Namespace(layers=61, e2e_repeat=int(sys.argv[1]), holder_bytes=2 << 30)
master = kvmove.EmbeddedMaster()
holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=2 << 30))
os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
try:
    for layout, case in (("layer_first", (32, 16)), ("page_first", (512, 1))):
        rec.clear()
        r = bs.bench_end_to_end(args, layout, holder, *case)
        print(layout, case, {k: round(v * 1e3, 2) for k, v in r["median_s"].items()}, "set x %.3f get x %.3f" % (r["speedup_set"], r["speedup_get"]))
        agg = {}
        for who, name, ms in rec: agg.setdefault((who, name), []).append(ms)
        for k, v in sorted(agg.items()): print("   ", k, len(v), "median %.2f ms" % statistics.median(v))
finally:
    holder.close(); master.stop()
