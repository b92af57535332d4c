# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-watched-calls/objects_stored_by.py
# the same native get (vLLM's descriptors) of objects stored by kvmove's in-place evict and by
# vLLM's own put path, paired: does who stored them change the read?
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, threading, sys
import numpy as np
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
from mooncake.store import ReplicateConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
a = torch.empty(32 << 20, dtype=torch.uint8); b = torch.empty_like(a)
vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vllm.register_kv_caches(src, nb)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
def keys():
    return fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    client = store._client
    store.register([(src[0].untyped_storage().data_ptr(), src[0].untyped_storage().nbytes())])
    kk, kv = keys(), keys()
    assert mover.evict(kk, block_pages(save_ids), detect_exists=False).wait() == [kvmove.Status.OK] * n
    addrs, sizes, _ = vllm.prepare_values(chunks, save_ids, [0] * n)
    assert all(r == 0 for r in client.batch_put_from_multi_buffers(kv, addrs, sizes, ReplicateConfig()))
    laddrs, lsizes, _ = vllm.prepare_values(chunks, load_ids, [0] * n)
    def get(k):
        def f():
            res = client.batch_get_into_multi_buffers(k, laddrs, lsizes); assert all(r > 0 for r in res)
        return f
    fns = dict(kvmove_saved=get(kk), vllm_saved=get(kv))
    rows = {name: [] for name in fns}
    names = list(fns)
    for r in range(60):
        for name in names[r % 2:] + names[:r % 2]:
            b.copy_(a)
            t0 = time.perf_counter(); fns[name](); dt = time.perf_counter() - t0
            if r >= 4: rows[name].append(dt)
    mover.close()
for name, v in rows.items():
    d = [x - y for x, y in zip(v, rows["vllm_saved"])]
    print(f"{name:14s} median {statistics.median(v)*1e3:.3f} ms; paired over vllm_saved {statistics.median(d)*1e6:.0f} us")
