# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/machinery.py 40 rest|gc [A,A0,J,...]
# Where kvmove's machinery costs at rest: bench_in_place's block-row in-place get, gc.collect() and a 20 ms sleep (or
# nothing: MODE gc) before each call, paired against the floor. A: as built; A0: the job not queued (no worker
# woken; the waiter runs it); S: the store's get replaced by the raw
# call on this thread and the statuses (no store bookkeeping, no bound, no hand-off); J: no Transfer, job or queue (the
# mover's _take_call and _get_in_place called here); JS: both; minimal: checks, describe_trusted, raw call, statuses.
import sys, time, gc, uuid, statistics
import numpy as np, torch
import kvmove, kvmove.store.mooncake_store as MS
from kvmove.checks import check_keys, small_rows_ok
from kvmove.status import Status
from kvmove.transfer import LayerProgress
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); MODE = sys.argv[2]
L, row, pages = 32, 16384, 96
num_slots = 4 * pages + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, 1, num_slots, seed=2)
obj = L * row
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    client = store._client
    store.register([(cache.data_ptr(), cache.numel())])
    src_spans, dst_spans = floor_spans(cache, src), floor_spans(cache, dst)
    sizes = [[row] * L] * pages
    m = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=pages, raw_keys=True, path="in_place")
    rows_ = m._prefetch_rows
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    assert all(c == 0 for c in client.batch_put_from_multi_buffers(keys, src_spans, sizes))
    valid1 = np.ones(pages, dtype=np.int64)
    real_get = MS.MooncakeStore.get
    def raw_get(self, desc, **kw):
        codes = client.batch_get_into_multi_buffers(desc.keys, desc.ptrs, desc.sizes)
        assert codes == desc.object_sizes()
        return MS.StoreResult([Status.OK] * len(codes), codes)
    def floor():
        assert client.batch_get_into_multi_buffers(keys, dst_spans, sizes) == [obj] * pages
    def a():
        assert m.prefetch(keys, dst).wait() == [Status.OK] * pages
    def s():
        MS.MooncakeStore.get = raw_get
        try:
            a()
        finally:
            MS.MooncakeStore.get = real_get
    def j():
        call = m._take_call(keys, dst, None, gathering=False)
        assert m._get_in_place(call, False, LayerProgress(L)).statuses == [Status.OK] * pages
    def js():
        MS.MooncakeStore.get = raw_get
        try:
            j()
        finally:
            MS.MooncakeStore.get = real_get
    def minimal():
        k = check_keys(keys)
        h = dst.numpy().astype(np.int64, copy=True)
        assert small_rows_ok(h, num_slots, unique=True)
        desc = rows_.describe_trusted(h, k, valid1, get=True)
        codes = client.batch_get_into_multi_buffers(desc.keys, desc.ptrs, desc.sizes)
        assert codes == desc.object_sizes()
    import kvmove.mover as MV
    real_start = MV.KVMover._start
    def a0():  # as built, but the job is not queued: the waiter runs it (no worker woken)
        MV.KVMover._start = lambda self, job: None
        try:
            t = m.prefetch(keys, dst)
        finally:
            MV.KVMover._start = real_start
        assert t.wait() == [Status.OK] * pages
    every = {"floor": floor, "A": a, "A0": a0, "S": s, "J": j, "JS": js, "minimal": minimal}
    chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else ["A", "S", "J", "JS", "minimal"]
    ops = {k: every[k] for k in ["floor", *chosen]}
    rows = {k: [] for k in ops}
    names = list(ops)
    for r in range(REPS + 3):
        k = r % len(names)
        for who in names[k:] + names[:k]:
            gc.collect()
            if MODE == "rest": time.sleep(0.02)
            t0 = time.perf_counter(); ops[who](); dt = time.perf_counter() - t0
            if r >= 3: rows[who].append(dt)
    pr = lambda a, b: statistics.median([x / y for x, y in zip(rows[a], rows[b])])
    print(f"{MODE}: " + " ".join(f"{w}/floor {pr(w, 'floor'):.3f}" for w in names[1:]) +
          f" | floor {statistics.median(rows['floor'])*1e3:.3f} ms")
    m.close()
