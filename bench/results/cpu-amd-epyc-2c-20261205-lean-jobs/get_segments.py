# throwaway: .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/get_segments.py 80
# the vLLM connector's in-place load of 256 blocks (16 layers), the native get faked by a 128 MiB copy (cold caches):
# medians of the time between marks (the wrapped functions' entries > and returns <); the sum leaves the fake native call out
# cold segments of the connector's in-place load (fake native get: a 128 MiB copy)
import time, statistics, hashlib, uuid, sys, functools
import torch, numpy as np
import kvmove
from kvmove.integrations.vllm.worker import block_mover, block_pages
from kvmove.integrations.vllm.layout import block_regions
import kvmove.mover as M, kvmove.store.mooncake_store as MS, kvmove.in_place as IP
import kvmove.store.bounded_call as BC, kvmove.transfer as T, kvmove.checks as CK
n, bs, L = 256, 16, 16
nb = 2 * n + 1
full = torch.zeros(L, nb, 8, bs, 128, dtype=torch.bfloat16)
src = [full[i] for i in range(L)]
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
a = torch.empty(128 << 20, dtype=torch.uint8); b = torch.empty_like(a); a.fill_(1)
size = L * 8 * bs * 128 * 2
MARKS = []
def mark(tag): MARKS.append((tag, time.perf_counter()))
def wrap(obj, name, tag):
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def f(*a, **k):
        mark(tag + ">"); r = orig(*a, **k); mark(tag + "<"); return r
    setattr(obj, name, f)
for obj, name, tag in [(M.KVMover, "prefetch", "prefetch"), (M.KVMover, "_take_call", "take"),
                       (M, "check_keys", "keys"), (M, "check_valid_tokens", "valid"),
                       (M.KVMover, "_get_in_place", "job"),
                       (IP.InPlaceRows, "describe_trusted", "describe"),
                       (MS.MooncakeStore, "get", "get"), (MS.MooncakeStore, "_using", "using"),
                       (MS.MooncakeStore, "_span_chunks", "chunks"), (MS.MooncakeStore, "_bounded", "bounded"),
                       (M.KVMover, "_count", "count"),
                       (M.KVMover, "_store_call", "storecall"),
                       (T.Transfer, "__init__", "transfer"), (M.KVMover, "_submit", "submit")]:
    wrap(obj, name, tag)
keys = ["bench-llama@tp0@pp0@" + hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).hexdigest() for i in range(n)]
class Fake:
    def __init__(s, real): s.real = real
    def __getattr__(s, name): return getattr(s.real, name)
    def batch_get_into_multi_buffers(s, keys, ptrs, sizes):
        mark("native>"); b.copy_(a); mark("native<")
        return [size] * len(keys)
with kvmove.MooncakeStore.embedded(global_segment_size=256 << 20) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    real = store._client; fake = Fake(real)
    store._client = store._state.client = fake
    store._budgets[id(fake)] = store._budgets[id(real)]; store._state.users[id(fake)] = 0
    OK = [kvmove.Status.OK] * n
    segs = {}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 60):
        b.copy_(a)
        MARKS.clear()
        mark("t0")
        t = mover.prefetch(keys, block_pages(load_ids))
        mark("returned")
        t.wait(timeout=600)
        mark("waited")
        assert t.wait() == OK
        t.scattered.synchronize()
        mark("t2")
        if r >= 5:
            prev = None
            for i, (tag, tt) in enumerate(MARKS):
                if prev is not None:
                    segs.setdefault(f"{i:02d} {prev[0]}->{tag}", []).append(tt - prev[1])
                prev = (tag, tt)
    tot = 0
    for k, v in sorted(segs.items()):
        m = statistics.median(v) * 1e6
        if "native>->native<" not in k: tot += m
        print(f"{k:40s} {m:7.1f} us")
    print("sum outside native", round(tot))
    store._client = store._state.client = real
    mover.close()
