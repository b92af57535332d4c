# throwaway: SGLang's MLA layer_first pool (61 layers, P-token pages), kvmove's SGLang backend
# (moving in place: KVMOVE_SGLANG_PATH=in_place) against a KVMover over the pool's pages (one
# row per page per layer, raw keys) with staging layout MLAYOUT (page_first: one span per
# object; layer_first: one per layer), through the backend's store; objects in a third
# client's segment over loopback TCP. argv: P pages path(staged|auto).
# KVMOVE_SGLANG_PATH=in_place MLAYOUT=page_first PYTHONPATH=. .venv-sglang/bin/python <this> 1 512 staged
import sys, os, time, statistics, uuid
sys.argv = [sys.argv[0]] + sys.argv[1:]
import bench  # noqa
import torch
from bench import bench_sglang as bs
import kvmove
P = int(sys.argv[1]); pages = int(sys.argv[2]); L = 61
master = kvmove.EmbeddedMaster()
holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=2 << 30))
os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
pool = bs.mla_pool("layer_first", layers=L, page_size=P, tokens=2 * pages * P)
sg, ours = bs.make_backends(f"x/{uuid.uuid4().hex[:6]}", False)
ours.register_mem_pool_host(pool)
kvb = pool.kv_buffer  # [L, size, 1, dim]
npages = kvb.shape[1] // P
rowb = P * kvb.shape[-1] * kvb.element_size()
layers = [kvb[l].view(torch.uint8).reshape(npages, rowb) for l in range(L)]
kv = kvmove.KVCache({"kv": layers})
path = sys.argv[3]
mover = kvmove.KVMover(kv, ours.store, page_tokens=1, staging_slots=max(4, min(pages, (256 << 20) // (rowb * L))), raw_keys=True, layout=os.environ.get("MLAYOUT", "page_first"), path=path, prefetch_into_free_rows=True)
print("mover path", mover.path_choice)
src = torch.arange(pages * P, dtype=torch.int64); dst = src + pages * P
res = {}
for r in range(6):
    keys = [uuid.uuid4().hex for _ in range(pages)]
    t0 = time.perf_counter(); ok = ours.batch_set_v1(keys, src); t1 = time.perf_counter()
    got = ours.batch_get_v1(keys, dst); t2 = time.perf_counter()
    assert all(ok) and all(got)
    res.setdefault("backend set", []).append(t1 - t0); res.setdefault("backend get", []).append(t2 - t1)
    objs = [k for ks in ours.keys.kv_objects(keys) for k in ks]
    holder.remove(objs, force=True)
    keys = [uuid.uuid4().hex for _ in range(pages)]
    objs = [k for ks in ours.keys.kv_objects(keys) for k in ks]
    sp = torch.arange(pages, dtype=torch.int64)[:, None]; dp = sp + pages
    t0 = time.perf_counter(); st = mover.evict(objs, sp).wait(); t1 = time.perf_counter()
    st2 = mover.prefetch(objs, dp).wait(); t2 = time.perf_counter()
    assert all(s == kvmove.Status.OK for s in st + st2), (st[:3], st2[:3])
    assert torch.equal(kvb[:, src], kvb[:, dst])
    res.setdefault("mover set", []).append(t1 - t0); res.setdefault("mover get", []).append(t2 - t1)
    holder.remove(objs, force=True)
nb = pages * P * L * 1152
print({k: f"{statistics.median(v[1:])*1e3:.1f} ms {nb/statistics.median(v[1:])/1e9:.2f} GB/s" for k, v in res.items()})
print(mover.stats())
mover.close(); ours.close(); sg.store.close(); holder.close(); master.stop()
