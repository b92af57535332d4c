# throwaway: the vLLM connector's in-place load (prefetch + wait at once), the job handed to a
# worker as shipped, or run by the waiting caller only (no worker), alternating in one process
import sys, time, statistics, hashlib, uuid, threading
import torch, kvmove
import kvmove.mover as mv
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
n, L, reps = 256, 16, int(sys.argv[1])
num_blocks = 2 * n + 1
src = llama_like_cache(L, num_blocks, 8, 16, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("st"), RankNamespace()
salt = uuid.uuid4().bytes
keys = fmt.keys(ns, [hashlib.sha256(salt + bytes([i % 256, i // 256])).digest() for i in range(n)])
mode = ["shipped"]
orig = mv.KVMover._submit
def _submit(self, fn, *args, executor=None):
    if mode[0] == "caller" and type(getattr(fn, "__self__", None)).__name__ == "StealableJob":
        from concurrent.futures import Future
        return Future()
    return orig(self, fn, *args, executor=executor)
mv.KVMover._submit = _submit
ran = {"caller": 0, "worker": 0}
orig_ex = kvmove.transfer.StealableJob._execute
def _execute(self):
    ran["caller" if threading.current_thread() is threading.main_thread() else "worker"] += 1
    return orig_ex(self)
kvmove.transfer.StealableJob._execute = _execute
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    assert mover.evict(keys, block_pages(save_ids)).wait() == [kvmove.Status.OK] * n
    t = {"shipped": [], "caller": []}
    for r in range(reps + 2):
        for who in (["shipped", "caller"] if r % 2 else ["caller", "shipped"]):
            mode[0] = who
            t0 = time.perf_counter()
            tr = mover.prefetch(keys, block_pages(load_ids))
            assert tr.wait() == [kvmove.Status.OK] * n
            dt = time.perf_counter() - t0
            if r >= 2: t[who].append(dt * 1e3)
    mover.close()
pr = [a / b for a, b in zip(t["shipped"], t["caller"])]
print("load", {w: round(statistics.median(v), 3) for w, v in t.items()}, ran, "paired shipped/caller %.4f q %s" % (statistics.median(pr), [round(x, 3) for x in statistics.quantiles(pr, n=4)]))
