# throwaway: kvmove's SGLang batch_get_v1/batch_set_v1 host time with Mooncake's calls answered at once
import sys, time, statistics, os, cProfile, pstats
import bench.bench_sglang as bs
import kvmove, torch, uuid
class Stub:
    def __init__(self, real): self.real = real
    def __getattr__(self, k): return getattr(self.real, k)
    def batch_is_exist(self, keys): return [0] * len(keys)
    def batch_put_from_multi_buffers(self, keys, p, s, c): return [0] * len(keys)
    def batch_get_into_multi_buffers(self, keys, p, s, *a): return [sum(x) for x in s]
master = kvmove.EmbeddedMaster()
holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=1 << 30))
os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
layout, pages, ps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pool = bs.mla_pool(layout, layers=61, page_size=ps, tokens=2 * pages * ps)
sglang, ours = bs.make_backends("x", layout != "layer_first")
sglang.register_mem_pool_host(pool); ours.register_mem_pool_host(pool)
c = ours.store._client; t = Stub(c)
ours.store._budgets[id(t)] = ours.store._budgets[id(c)]; ours.store._client = ours.store._state.client = t
sglang.store = Stub(sglang.store)
src = torch.arange(pages * ps, dtype=torch.int64)
keys = [uuid.uuid4().hex for _ in range(pages)]
res = {}
for r in range(60):
    for name, b in (("sglang", sglang), ("kvmove", ours)):
        t0 = time.perf_counter(); b.batch_set_v1(keys, src); t1 = time.perf_counter(); b.batch_get_v1(keys, src); t2 = time.perf_counter()
        if r >= 10:
            res.setdefault(name + " set", []).append((t1 - t0) * 1e6); res.setdefault(name + " get", []).append((t2 - t1) * 1e6)
print(layout, pages, ps, {k: round(statistics.median(v)) for k, v in res.items()}, "µs")
if len(sys.argv) > 4:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): ours.batch_get_v1(keys, src) if sys.argv[4] == "get" else ours.batch_set_v1(keys, src)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
sglang.close(); ours.close(); holder.close(); master.stop()
