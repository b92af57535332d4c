# throwaway: .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/cold_parts.py
# each piece of the in-place load's Python alone, after a 128 MiB copy (its own cold misses: more than in sequence)
# cold cost of the pieces of an in-place get's Python (each after a 128 MiB copy)
import time, statistics, hashlib, uuid, functools
import torch, numpy as np
import kvmove
from kvmove.integrations.vllm.worker import block_mover, block_pages
from kvmove.integrations.vllm.layout import block_regions
from kvmove.store import bounded_call as BC
from kvmove.store.mooncake_store import StoreResult
from kvmove.checks import check_keys
n, bs, L = 256, 16, 16
nb = 2 * n + 1
full = torch.zeros(L, nb, 8, bs, 128, dtype=torch.bfloat16)
src = [full[i] for i in range(L)]
load_ids = list(range(0, 2 * n, 2))
a = torch.empty(128 << 20, dtype=torch.uint8); b = torch.empty_like(a); a.fill_(1)
keys = ["bench-llama@tp0@pp0@" + hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).hexdigest() for i in range(n)]
with kvmove.MooncakeStore.embedded(global_segment_size=256 << 20) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    rows = mover._prefetch_rows
    pages = block_pages(load_ids)
    valid = np.ones(n, dtype=np.int64)
    desc = rows.describe_trusted(pages, keys, valid, get=True)
    client = store._client
    budget = store._budgets[id(client)]
    codes = [desc.nbytes(0)] * n
    OK = [kvmove.Status.OK] * n
    def using():
        with store._using(client, desc):
            pass
    def slot():
        with store._call_slot():
            pass
    parts = {
        "block_pages": lambda: block_pages(load_ids),
        "check_keys": lambda: check_keys(keys),
        "take_call": lambda: mover._take_call(keys, pages, None, gathering=False),
        "Transfer()": lambda: kvmove.Transfer(keys, kind="prefetch", num_layers=16),
        "describe_trusted": lambda: rows.describe_trusted(pages, keys, valid, get=True),
        "store_keys": lambda: mover.keyspace.store_keys(keys),
        "call_slot": slot,
        "using": using,
        "span_chunks": lambda: store._span_chunks(rows.describe_trusted(pages, keys, valid, get=True)),
        "object_sizes": lambda: desc.object_sizes(),
        "budget acq+rel": lambda: budget.release(budget.acquire(4096, 5)),
        "call_watched(noop)": lambda: BC.call_watched(lambda: codes, timeout=5),
        "codes==expected": lambda: codes == desc.object_sizes(),
        "StoreResult": lambda: StoreResult([kvmove.Status.OK] * n, codes),
        "count": lambda: OK.count(kvmove.Status.OK),
        "nothing": lambda: None,
    }
    res = {k: [] for k in parts}
    for r in range(60):
        for k, f in parts.items():
            b.copy_(a)
            t0 = time.perf_counter(); f(); dt = time.perf_counter() - t0
            if r >= 5: res[k].append(dt)
    for k, v in res.items():
        print(f"{k:22s} {statistics.median(v)*1e6:6.1f} us")
    mover.close()
