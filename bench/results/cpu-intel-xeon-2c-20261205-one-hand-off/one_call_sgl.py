# throwaway: kvmove's SGLang batch_set_v1 with the exists check and the put in one runner call
# and in two (as before), alternating in one process, same pool and store
import sys, time, statistics, os, uuid
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
def two_calls(client, part):
    return store._batch(client.batch_is_exist, part.keys), None
src = torch.arange(pages * ps, dtype=torch.int64)
t = {"one": [], "two": []}
for r in range(reps + 2):
    for who in (("one", "two") if r % 2 else ("two", "one")):
        if who == "two": store._check_then_put = two_calls
        else: store.__dict__.pop("_check_then_put", None)
        keys = [uuid.uuid4().hex for _ in range(pages)]
        t0 = time.perf_counter(); ok = ours.batch_set_v1(keys, src); dt = time.perf_counter() - t0
        assert all(ok)
        if r >= 2: t[who].append(dt * 1e3)
        holder.remove([k for ks in ours.keys.kv_objects(keys) for k in ks], force=True)
pr = [a / b for a, b in zip(t["two"], t["one"])]
print("sglang set", layout, pages, ps, {k: round(statistics.median(v), 3) for k, v in t.items()}, "paired two/one %.3f q %s" % (statistics.median(pr), [round(x, 3) for x in statistics.quantiles(pr, n=4)]))
sglang.close(); sglang.store.close(); ours.close(); holder.close(); master.stop()
