# throwaway: kvmove's in-place save with Mooncake's two calls answered at once (no bytes move):
# what's left is kvmove's own host time (+ the thread hand-offs), warm; and vLLM's own path the same
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
save_ids = list(range(2 * n - 1, 0, -2))[:n]
fmt, ns = VLLMKeyFormat("ab"), RankNamespace()
keys = fmt.keys(ns, [hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(n)])
class FakeClient:
    def __init__(self, real): self.real = real
    def __getattr__(self, k): return getattr(self.real, k)
    def batch_is_exist(self, k): return [0] * len(k)
    def batch_put_from_multi_buffers(self, k, p, s, c): return [0] * len(k)
with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    fake = FakeClient(store._client)
    store._client = store._state.client = fake
    store._budgets[id(fake)] = store._budgets[id(fake.real)]
    vllm = RankLocalStoreLayout(KeyMetadata("ab", 0, 0, 0, 0), 16, 16)
    vllm.register_kv_caches(src, num_blocks)
    chunks = [(i * 16, (i + 1) * 16) for i in range(n)]
    from mooncake.store import ReplicateConfig
    rc = ReplicateConfig()
    def vllm_save(k):
        exists = fake.batch_is_exist(k)
        todo = [i for i, e in enumerate(exists) if e != 1]
        addrs, sizes, _ = vllm.prepare_values([chunks[i] for i in todo], [save_ids[i] for i in todo], [0] * len(todo))
        res = fake.batch_put_from_multi_buffers([k[i] for i in todo], addrs, sizes, rc)
        assert all(r == 0 for r in res)
    thread = transfer_thread(16)
    def on_thread(k):
        done = threading.Event(); thread.add_request((lambda: vllm_save(k), done)); done.wait()
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    t = {"kvmove": [], "vllm-thread": [], "kvmove-cold": [], "vllm-thread-cold": []}
    for r in range(reps):
        for who, fn in (("kvmove", lambda: mover.evict(keys, block_pages(save_ids)).wait()), ("vllm-thread", lambda: on_thread(keys))):
            for cold in (False, True):
                if cold: flush.fill_(r & 0xff)  # evicts the caches as a big transfer does
                t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
                t[who + ("-cold" if cold else "")].append(dt * 1e6)
    mover.close()
print({w: round(statistics.median(v), 1) for w, v in t.items()})
