# throwaway: kvmove's SGLang batch_set_v1 with begin_put (the exists check begun before describing)
# and with the plain put (check inside), alternating in one process, same pool and store
import sys, time, statistics, os, uuid, contextlib
import bench.bench_sglang as bs
import kvmove, torch
master = kvmove.EmbeddedMaster()
holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=2 << 30))
os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
layout, pages, ps, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pool = bs.mla_pool(layout, layers=61, page_size=ps, tokens=2 * pages * ps)
sglang, ours = bs.make_backends("ab", layout != "layer_first")
ours.register_mem_pool_host(pool)
store = ours.store
real_begin = store.begin_put
class Plain:
    def __init__(self, keys, detect_exists=None): self.d = detect_exists
    def __enter__(self): return self
    def __exit__(self, *e): pass
    def put(self, desc): return store.put(desc, detect_exists=self.d)
src = torch.arange(pages * ps, dtype=torch.int64)
t = {"early": [], "plain": []}
for r in range(reps + 2):
    for who in (("early", "plain") if r % 2 else ("plain", "early")):
        store.begin_put = real_begin if who == "early" else Plain
        keys = [uuid.uuid4().hex for _ in range(pages)]
        t0 = time.perf_counter(); ok = ours.batch_set_v1(keys, src); dt = time.perf_counter() - t0
        assert all(ok)
        if r >= 2: t[who].append(dt * 1e3)
        holder.remove([k for ks in ours.keys.kv_objects(keys) for k in ks], force=True)
store.begin_put = real_begin
pr = [a / b for a, b in zip(t["plain"], t["early"])]
print(layout, pages, ps, {k: round(statistics.median(v), 3) for k, v in t.items()}, "paired plain/early %.3f q %s" % (statistics.median(pr), [round(x, 3) for x in statistics.quantiles(pr, n=4)]))
sglang.close(); sglang.store.close(); ours.close(); holder.close(); master.stop()
