# throwaway: pieces of an in-place prefetch's Python (the vLLM bench's 256 blocks), each timed
# cold (right after a 32 MiB copy) / hot (back to back), medians in µs; and the store's chunks.
# PYTHONPATH=. .venv-vllm/bin/python <this>
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, numpy as np
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
from kvmove.checks import check_keys, as_index_tensor
from kvmove.transfer import Transfer
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
a = torch.empty(32 << 20, dtype=torch.uint8); b = torch.empty_like(a)
def cold(fn, reps=200):
    v = []
    for _ in range(reps):
        b.copy_(a)
        t0 = time.perf_counter_ns(); fn(); v.append(time.perf_counter_ns() - t0)
    return statistics.median(v) / 1e3
def hot(fn, reps=200):
    fn()
    v = []
    for _ in range(reps):
        t0 = time.perf_counter_ns(); fn(); v.append(time.perf_counter_ns() - t0)
    return statistics.median(v) / 1e3
with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
    bp = block_pages(load_ids)
    call = mover._take_call(k, bp, None, gathering=False)
    store_keys = mover.keyspace.store_keys(call.keys)
    pages = call.pages.numpy()
    desc = mover._prefetch_rows.describe_trusted(pages, store_keys, call.valid, get=True)
    pieces = {
        "block_pages": lambda: block_pages(load_ids),
        "check_keys": lambda: check_keys(k),
        "as_index_tensor": lambda: as_index_tensor(bp, "token_pages", dim=2, device=mover.device),
        "_take_call": lambda: mover._take_call(k, bp, None, gathering=False),
        "Transfer()": lambda: Transfer(k, kind="prefetch", num_layers=16, device=mover.device),
        "store_keys": lambda: mover.keyspace.store_keys(k),
        "describe_trusted": lambda: mover._prefetch_rows.describe_trusted(pages, store_keys, call.valid, get=True),
        "_check_desc": lambda: store._check_desc(desc),
        "_span_chunks": lambda: store._span_chunks(desc),
        "object_sizes": lambda: desc.object_sizes(),
        "noop": lambda: None,
    }
    for r in range(2):
        print(" | ".join(f"{name} {cold(f):.1f}/{hot(f):.1f}" for name, f in pieces.items()))

    print("chunks", store._span_chunks(desc), "limits", store.limits, "max_batch_keys", store.config.max_batch_keys, "spans", desc.num_spans, "bytes", desc.total_bytes)
    mover.close()
