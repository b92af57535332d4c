# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/marks.py 40 <settle seconds>
# marks along kvmove's in-place block-row get (bench_in_place's shape), real native call; medians between consecutive marks
import sys, time, gc, uuid, statistics, functools, threading
import numpy as np, torch
import kvmove
import kvmove.mover as M, kvmove.store.mooncake_store as MS, kvmove.in_place as IP, kvmove.transfer as T
import kvmove.store.bounded_call as BC, kvmove.job_threads as JT
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); SETTLE = float(sys.argv[2])
MARKS = []
def mark(tag): MARKS.append((tag, time.perf_counter(), threading.current_thread().name[:6]))
def wrap(obj, name, tag):
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def f(*a, **k):
        mark(tag + ">"); r = orig(*a, **k); mark(tag + "<"); return r
    setattr(obj, name, f)
for obj, name, tag in [(M.KVMover, "prefetch", "prefetch"), (M.KVMover, "_take_call", "take"),
                       (M, "check_keys", "keys"),
                       (T.Transfer, "__init__", "transfer"), (M.KVMover, "_start", "start"),
                       (T.StealableJob, "_execute", "exec"),
                       (M.KVMover, "_get_in_place", "job"), (M.KVMover, "_host_pages", "hostpages"),
                       (IP.InPlaceRows, "describe_trusted", "describe"),
                       (M.KVMover, "_store_call", "storecall"),
                       (MS.MooncakeStore, "get", "get"), (MS.MooncakeStore, "_use", "use"),
                       (MS.MooncakeStore, "_span_chunks", "chunks"), (MS.MooncakeStore, "_bounded", "bounded"),
                       (MS.MooncakeStore, "_release", "release"),
                       (M.KVMover, "_count", "count"), (T.LayerProgress, "all_done", "alldone")]:
    wrap(obj, name, tag)
L, row, pages = 32, 16384, 96
num_slots = 4 * pages + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, 1, num_slots, seed=2)
class Watch:
    def __init__(s, real): s.real = real
    def __getattr__(s, n): return getattr(s.real, n)
    def batch_get_into_multi_buffers(s, *a):
        mark("native>"); r = s.real.batch_get_into_multi_buffers(*a); mark("native<"); return r
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
    segs = {}
    for r in range(REPS + 3):
        gc.collect(); time.sleep(SETTLE)
        MARKS.clear()
        mark("t0"); t = m.prefetch(keys, dst); mark("returned"); t.wait(); mark("waited")
        if r >= 3:
            prev = None
            for i, (tag, tt, th) in enumerate(MARKS):
                if prev is not None:
                    segs.setdefault(f"{i:02d} {prev[0]}->{tag} [{th}]", []).append(tt - prev[1])
                prev = (tag, tt)
    tot = 0
    for k, v in sorted(segs.items()):
        md = statistics.median(v) * 1e6
        if "native>->native<" not in k: tot += md
        print(f"{k:48s} {md:7.1f} us  (n={len(v)})")
    print("sum outside native", round(tot))
    store._client = store._state.client = client
    m.close()
