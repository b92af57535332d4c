# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/minimal.py 40 gc|rest
# How low could kvmove's in-place get go? bench_in_place's block-row get, gc.collect() (or a 20 ms rest) before each:
# the floor (raw get, main), kvmove as built (A), and a minimal sequence on the main thread (the same checks and
# describe_trusted, then the raw get, then the statuses): what a one-function fast path would cost.
import sys, time, gc, uuid, statistics
import numpy as np, torch
import kvmove
from kvmove.checks import check_keys, small_rows_ok
from kvmove.status import Status
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
    def floor():
        assert client.batch_get_into_multi_buffers(keys, dst_spans, sizes) == [obj] * pages
    def mover():
        assert m.prefetch(keys, dst).wait() == [Status.OK] * pages
    def minimal():
        k = check_keys(keys)
        h = dst.numpy().astype(np.int64, copy=True)
        assert small_rows_ok(h, num_slots, unique=True)
        desc = rows_.describe_trusted(h, k, valid1, get=True)
        codes = client.batch_get_into_multi_buffers(desc.keys, desc.ptrs, desc.sizes)
        st = [Status.OK] * len(codes) if codes == desc.object_sizes() else None
        assert st is not None
    ops = {"floor": floor, "A": mover, "minimal": minimal}
    rows = {k: [] for k in ops}
    names = list(ops)
    for r in range(REPS + 3):
        k = r % len(names)
        for who in names[k:] + names[:k]:
            gc.collect()
            if MODE == "rest": time.sleep(0.02)
            t0 = time.perf_counter(); ops[who](); dt = time.perf_counter() - t0
            if r >= 3: rows[who].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    pr = lambda a, b: statistics.median([x / y for x, y in zip(rows[a], rows[b])])
    print(f"{MODE}: ms " + " ".join(f"{k} {v:.3f}" for k, v in med.items()) +
          f" | A/floor {pr('A', 'floor'):.3f} minimal/floor {pr('minimal', 'floor'):.3f}")
    m.close()
