# throwaway: kvmove's vLLM-connector save (in place, put in the background) with the exists
# check and the put in one runner call and in two (as before), alternating in one process
import sys, time, statistics, hashlib, uuid
import torch, kvmove
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
n, L, reps = 256, 16, int(sys.argv[1])
num_blocks = 2 * n + 1
src = llama_like_cache(L, num_blocks, 8, 16, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
fmt, ns = VLLMKeyFormat("ab"), RankNamespace()
def keys():
    salt = uuid.uuid4().bytes
    return fmt.keys(ns, [hashlib.sha256(salt + bytes([i % 256, i // 256])).digest() for i in range(n)])
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    def two_calls(client, part):
        return store._batch(client.batch_is_exist, part.keys), None
    t = {"one": [], "two": []}
    for r in range(reps + 2):
        order = ["one", "two"] if r % 2 else ["two", "one"]
        for who in order:
            k = keys()
            if who == "two": store._check_then_put = two_calls
            else: store.__dict__.pop("_check_then_put", None)
            t0 = time.perf_counter()
            assert mover.evict(k, block_pages(save_ids)).wait() == [kvmove.Status.OK] * n
            dt = time.perf_counter() - t0
            if r >= 2: t[who].append(dt * 1e3)
            store.remove(k, force=True)
    mover.close()
pr = [a / b for a, b in zip(t["two"], t["one"])]
print("vllm save", {w: round(statistics.median(v), 3) for w, v in t.items()}, "paired two/one median %.4f q %s" % (statistics.median(pr), [round(x, 3) for x in statistics.quantiles(pr, n=4)]))
