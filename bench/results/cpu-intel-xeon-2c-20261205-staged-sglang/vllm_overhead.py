# throwaway: vLLM's worker path (exists, prepare_values, put, inline) against kvmove's
# in-place evict of the same blocks, alternating, with kvmove's own Mooncake calls timed
# inside it: the time each spends around the same calls. Medians of 10.
# PYTHONPATH=. .venv-vllm/bin/python <this>
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid
from bench.bench_vllm import llama_like_cache
from mooncake.store import ReplicateConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
storage = src[0].untyped_storage()
save_ids = list(range(2 * n - 1, 0, -2))[:n]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vllm.register_kv_caches(src, nb)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
res = {}
def add(k, v): res.setdefault(k, []).append(v * 1e3)
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    client = store._client
    import threading
    class Proxy:
        def __init__(self, c): self._c = c
        def __getattr__(self, a):
            f = getattr(self._c, a)
            if not a.startswith("batch_"): return f
            def w(*args, **kw):
                t0 = time.perf_counter(); r = f(*args, **kw); add("kvmove " + a, time.perf_counter() - t0)
                if a.startswith("batch_put"): add("kvmove spans/key", len(args[1][0]) / 1e3)
                return r
            return w
    store._state.users[id(Proxy)] = 0
    store._client = Proxy(client)
    store.register([(storage.data_ptr(), storage.nbytes())])
    rep = ReplicateConfig()
    for r in range(12):
        k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        k2 = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        t0 = time.perf_counter(); ex = client.batch_is_exist(k); t1 = time.perf_counter()
        addrs, sizes, _ = vllm.prepare_values(chunks, save_ids, [0] * n); t2 = time.perf_counter()
        out = client.batch_put_from_multi_buffers(k, addrs, sizes, rep); t3 = time.perf_counter()
        add("vllm exist", t1 - t0); add("vllm prepare", t2 - t1); add("vllm put", t3 - t2); add("vllm total", t3 - t0)
        t0 = time.perf_counter(); t = mover.evict(k2, block_pages(save_ids)); t.wait(); t1 = time.perf_counter()
        add("kvmove total", t1 - t0)
        store.remove(k + k2, force=True)
    print({a: round(statistics.median(b[2:]), 3) for a, b in res.items()})
    print("spans per key vllm", len(addrs[0]), sizes[0][:3])
    mover.close()
