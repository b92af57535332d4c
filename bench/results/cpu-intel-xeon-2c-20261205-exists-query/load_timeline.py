# throwaway: load (and save) in place: time from the call to Mooncake's first native call,
# and from its last one's return to the caller's wait returning; kvmove (the save with the
# exists query, and without it, as the connector saves new blocks) against vLLM's path on
# its thread. The vLLM bench's blocks (256 x 16 layers); medians of 18.
# PYTHONPATH=. .venv-vllm/bin/python <this> [repeats]
import bench  # noqa
import time, statistics, threading, torch, kvmove, hashlib, uuid, sys
from bench.bench_vllm import llama_like_cache, transfer_thread
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
from mooncake.store import ReplicateConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
T = {}
def mark(name): T[name] = time.perf_counter()
class Proxy:
    def __init__(self, c): self._c = c
    def __getattr__(self, a):
        f = getattr(self._c, a)
        if not a.startswith("batch_"): return f
        def w(*args, **kw):
            mark(a + ">"); r = f(*args, **kw); mark(a + "<"); return r
        return w
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
storage = src[0].untyped_storage()
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vllm.register_kv_caches(src, nb)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
thread = transfer_thread(bs)
res = {}
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    store.register([(storage.data_ptr(), storage.nbytes())])
    client = store._client
    p = Proxy(client); store._state.users[id(Proxy)] = 0; store._client = p
    rep = ReplicateConfig()
    def vsave(k):
        ex = p.batch_is_exist(k)
        addrs, sizes, _ = vllm.prepare_values(chunks, save_ids, [0] * n)
        p.batch_put_from_multi_buffers(k, addrs, sizes, rep)
    def vload(k):
        addrs, sizes, _ = vllm.prepare_values(chunks, load_ids, [0] * n)
        p.batch_get_into_multi_buffers(k, addrs, sizes)
    def on_thread(fn, k):
        done = threading.Event(); thread.add_request((lambda: fn(k), done)); done.wait()
    def add(who, op, first, last):
        res.setdefault((who, op, "before"), []).append((T[first] - T["call"]) * 1e3)
        res.setdefault((who, op, "after"), []).append((T["waited"] - T[last]) * 1e3)
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        k2 = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        T.clear(); mark("call"); t = mover.evict(k, block_pages(save_ids)); t.wait(); mark("waited")
        add("kvmove", "save", "batch_is_exist>", "batch_put_from_multi_buffers<")
        k3 = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        T.clear(); mark("call"); t = mover.evict(k3, block_pages(save_ids), detect_exists=False); t.wait(); mark("waited")
        add("kvmove (no query)", "save", "batch_put_from_multi_buffers>", "batch_put_from_multi_buffers<")
        T.clear(); mark("call"); on_thread(vsave, k2); mark("waited")
        add("vllm", "save", "batch_is_exist>", "batch_put_from_multi_buffers<")
        T.clear(); mark("call"); t = mover.prefetch(k, block_pages(load_ids)); t.wait(); mark("waited")
        add("kvmove", "load", "batch_get_into_multi_buffers>", "batch_get_into_multi_buffers<")
        T.clear(); mark("call"); on_thread(vload, k2); mark("waited")
        add("vllm", "load", "batch_get_into_multi_buffers>", "batch_get_into_multi_buffers<")
        store.remove(k + k2 + k3, force=True)
    for key, v in sorted(res.items()): print(key, f"{statistics.median(v[2:]):.3f} ms")
    mover.close()
