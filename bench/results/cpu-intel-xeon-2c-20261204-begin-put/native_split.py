# throwaway: kvmove's in-place save and vLLM's (on its transfer thread), real Mooncake calls,
# each native call timed; alternating, same blocks, same store
import sys, time, statistics, hashlib, uuid, threading
import torch, kvmove
from bench.bench_vllm import llama_like_cache, transfer_thread
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
n, L, reps = 256, 16, int(sys.argv[1])
num_blocks = 2 * n + 1
src = llama_like_cache(L, num_blocks, 8, 16, 64)
storage = src[0].untyped_storage()
save_ids = list(range(2 * n - 1, 0, -2))[:n]
fmt, ns = VLLMKeyFormat("ab"), RankNamespace()
def newkeys():
    salt = uuid.uuid4().bytes
    return fmt.keys(ns, [hashlib.sha256(salt + bytes([i % 256, i // 256])).digest() for i in range(n)])
rec = []
class Timed:
    def __init__(self, real): self.real = real
    def __getattr__(self, k): return getattr(self.real, k)
    def batch_is_exist(self, k):
        t0 = time.perf_counter(); r = self.real.batch_is_exist(k); rec.append(("exist", t0, time.perf_counter())); return r
    def batch_put_from_multi_buffers(self, k, p, s, c):
        t0 = time.perf_counter(); r = self.real.batch_put_from_multi_buffers(k, p, s, c); rec.append(("put", t0, time.perf_counter(), p, s)); return r
with kvmove.MooncakeStore.embedded(global_segment_size=8 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    client = Timed(store._client)
    store._client = store._state.client = client
    store._budgets[id(client)] = store._budgets[id(client.real)]
    store.register([(storage.data_ptr(), storage.nbytes())])
    vllm = RankLocalStoreLayout(KeyMetadata("ab", 0, 0, 0, 0), 16, 16)
    vllm.register_kv_caches(src, num_blocks)
    chunks = [(i * 16, (i + 1) * 16) for i in range(n)]
    from mooncake.store import ReplicateConfig
    rc = ReplicateConfig()
    def vllm_save(k):
        exists = client.batch_is_exist(k)
        todo = [i for i, e in enumerate(exists) if e != 1]
        addrs, sizes, _ = vllm.prepare_values([chunks[i] for i in todo], [save_ids[i] for i in todo], [0] * len(todo))
        res = client.batch_put_from_multi_buffers([k[i] for i in todo], addrs, sizes, rc)
        assert all(r == 0 for r in res)
    thread = transfer_thread(16)
    def on_thread(k):
        done = threading.Event(); thread.add_request((lambda: vllm_save(k), done)); done.wait()
    t = {"kvmove": [], "vllm": []}
    shown = False
    for r in range(reps + 2):
        order = [("kvmove", lambda k: mover.evict(k, block_pages(save_ids)).wait()), ("vllm", on_thread)]
        if r % 2: order.reverse()
        for who, fn in order:
            k = newkeys(); rec.clear()
            t0 = time.perf_counter(); fn(k); t1 = time.perf_counter()
            ex = [x for x in rec if x[0] == "exist"][0]; put = [x for x in rec if x[0] == "put"][0]
            if not shown and who == "kvmove" or r == 0 and who == "vllm":
                print(who, "spans/key", len(put[3][0]), "first spans", put[3][0][:3], put[4][0][:3])
                shown = True
            if r >= 2:
                t[who].append(((t1 - t0) * 1e3, (put[2] - put[1]) * 1e3, (ex[2] - ex[1]) * 1e3, (t1 - t0 - (put[2] - put[1]) - (ex[2] - ex[1])) * 1e3))
            store.remove(k, force=True)
    mover.close()
for who, v in t.items():
    print(who, "total %.2f put %.2f exist %.3f rest %.3f outside-put %.3f ms" % (*[statistics.median(x[i] for x in v) for i in range(4)], statistics.median(x[0] - x[1] for x in v)))
pr = [b[1] / a[1] for a, b in zip(t["kvmove"], t["vllm"])]
print("native put vllm/kvmove paired median %.4f" % statistics.median(pr))
