# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-intel-xeon-2c-20261205-async-loads/returns.py
# where the engine thread's time goes in the connector's save/load calls (bench_vllm geometry)
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, sys
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
import kvmove.mover as M
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
stamps = {}
orig_take = M.KVMover._take_call
def take(self, *a, **k):
    t0 = time.perf_counter(); r = orig_take(self, *a, **k); stamps["take"] = time.perf_counter() - t0; return r
M.KVMover._take_call = take
orig_submit = M.KVMover._submit
def submit(self, *a, **k):
    t0 = time.perf_counter(); r = orig_submit(self, *a, **k); stamps["submit"] = time.perf_counter() - t0; return r
M.KVMover._submit = submit
rows = {k: [] for k in ("save total", "save take", "save submit", "load total", "load take", "load submit", "pages")}
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    for r in range(25):
        k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
        t0 = time.perf_counter(); p = block_pages(save_ids); t1 = time.perf_counter()
        t = mover.evict(k, p, detect_exists=False); t2 = time.perf_counter()
        t.wait()
        rows["pages"].append(t1 - t0); rows["save total"].append(t2 - t1)
        rows["save take"].append(stamps["take"]); rows["save submit"].append(stamps["submit"])
        p = block_pages(load_ids)
        t1 = time.perf_counter(); t = mover.prefetch(k, p); t2 = time.perf_counter()
        t.wait(timeout=60)
        rows["load total"].append(t2 - t1); rows["load take"].append(stamps["take"]); rows["load submit"].append(stamps["submit"])
        store.remove(k, force=True)
    mover.close()
for name, v in rows.items():
    v = v[3:]
    print(f"{name:14s} median {statistics.median(v)*1e6:7.1f} µs  min {min(v)*1e6:7.1f}  max {max(v)*1e6:7.1f}")
