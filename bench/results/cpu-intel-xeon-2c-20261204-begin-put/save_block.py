# throwaway: how long a vLLM-connector save holds the engine's thread: the mover's evict() return
# with the put in the background (blocks held by vLLM's scheduler) vs on the caller's thread
import sys, time, statistics, hashlib, uuid
import torch, kvmove
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_pages
n, L, reps = 256, 16, int(sys.argv[1])
num_blocks = 2 * n + 1
src = llama_like_cache(L, num_blocks, 8, 16, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
fmt, ns = VLLMKeyFormat("sb"), RankNamespace()
def keys():
    salt = uuid.uuid4().bytes
    return fmt.keys(ns, [hashlib.sha256(salt + bytes([i % 256, i // 256])).digest() for i in range(n)])
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
    cache = kvmove.KVCache({"kv": views})
    movers = {bg: kvmove.KVMover(cache, store, page_tokens=1, staging_slots=n, raw_keys=True, path="in_place", put_in_background=bg) for bg in (True, False)}
    t = {True: [], False: []}; total = {True: [], False: []}
    for r in range(reps + 2):
        for bg in ((True, False) if r % 2 else (False, True)):
            k = keys()
            t0 = time.perf_counter(); tr = movers[bg].evict(k, block_pages(save_ids)); t1 = time.perf_counter()
            assert tr.wait() == [kvmove.Status.OK] * n; t2 = time.perf_counter()
            if r >= 2: t[bg].append((t1 - t0) * 1e3); total[bg].append((t2 - t0) * 1e3)
            store.remove(k, force=True)
    for m in movers.values(): m.close()
for bg in (False, True):
    print("put in background" if bg else "put on the caller's thread", "evict returns after %.3f ms (median), put done after %.2f ms" % (statistics.median(t[bg]), statistics.median(total[bg])))
