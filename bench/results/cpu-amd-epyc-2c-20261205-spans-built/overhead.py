# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/overhead.py 40 <settle seconds>
# in-place block-row get: kvmove's time outside its native call, and its native call against the floor's, settle mode
import sys, time, gc, uuid, statistics
import numpy as np, torch
import kvmove
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); SETTLE = float(sys.argv[2])
L, row, pages = 32, 16384, 96
num_slots = 4 * pages + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, 1, num_slots, seed=2)
obj = L * row
NAT = []
class Watch:
    def __init__(s, real): s.real = real
    def __getattr__(s, n): return getattr(s.real, n)
    def batch_get_into_multi_buffers(s, *a):
        t0 = time.perf_counter(); r = s.real.batch_get_into_multi_buffers(*a); NAT.append((t0, time.perf_counter())); return r
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    client = store._client
    store.register([(cache.data_ptr(), cache.numel())])
    src_spans, dst_spans = floor_spans(cache, src), floor_spans(cache, dst)
    sizes = [[row] * L] * pages
    m = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=pages, raw_keys=True, path="in_place")
    w = Watch(client)
    store._client = store._state.client = w
    store._budgets[id(w)] = store._budgets[id(client)]; store._state.users[id(w)] = 0
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    assert all(c == 0 for c in client.batch_put_from_multi_buffers(keys, src_spans, sizes))
    fl, kt, kn, pre, post = [], [], [], [], []
    for r in range(REPS + 3):
        for who in ("floor", "kv") if r % 2 else ("kv", "floor"):
            gc.collect(); time.sleep(SETTLE)
            if who == "floor":
                t0 = time.perf_counter(); client.batch_get_into_multi_buffers(keys, dst_spans, sizes); t1 = time.perf_counter()
                if r >= 3: fl.append(t1 - t0)
            else:
                NAT.clear()
                t0 = time.perf_counter(); m.prefetch(keys, dst).wait(); t1 = time.perf_counter()
                a, b = NAT[0]
                if r >= 3: kt.append(t1 - t0); kn.append(b - a); pre.append(a - t0); post.append(t1 - b)
    md = lambda v: statistics.median(v) * 1e6
    print(f"settle {SETTLE}: floor {md(fl):.0f} us; kvmove {md(kt):.0f} (native {md(kn):.0f}, before {md(pre):.0f}, after {md(post):.0f}); "
          f"kvmove native/floor paired {statistics.median([a/b for a,b in zip(kn, fl)]):.3f}, total/floor {statistics.median([a/b for a,b in zip(kt, fl)]):.3f}")
    store._client = store._state.client = client
    m.close()
