# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/steal_or_not.py 40 <settle seconds> get nosteal
# bench_in_place's block-row in-place get by two movers in one process, paired against the raw get (the floor) on the main
# thread, gc.collect() and then a sleep of <settle> before each call: A as built, B not stealing its job on the main thread
# (nosteal)
# A/B of in-place prefetch variants in one process, real Mooncake gets, paired against the floor
import sys, time, gc, uuid, statistics, contextlib
import numpy as np, torch
import kvmove
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); SETTLE = float(sys.argv[2]); OP = sys.argv[3] if len(sys.argv) > 3 else "get"
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
    A = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=pages, raw_keys=True, path="in_place")
    B = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=pages, raw_keys=True, path="in_place")
    VARIANT = sys.argv[4] if len(sys.argv) > 4 else "nosteal"
    if VARIANT == "nosteal":
        @contextlib.contextmanager
        def refuse():
            yield False
        B._inline_run = refuse
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    codes = client.batch_put_from_multi_buffers(keys, src_spans, sizes)
    assert all(c == 0 for c in codes)
    def floor():
        assert client.batch_get_into_multi_buffers(keys, dst_spans, sizes) == [obj] * pages
    def mv(m):
        return lambda: m.prefetch(keys, dst).wait()
    ops = {"floor": floor, "A": mv(A), "B": mv(B)}
    rows = {k: [] for k in ops}
    names = list(ops)
    for r in range(REPS + 3):
        order = names[r % 3:] + names[:r % 3]
        for who in order:
            gc.collect(); time.sleep(SETTLE)
            t0 = time.perf_counter(); ops[who](); dt = time.perf_counter() - t0
            if r >= 3: rows[who].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    pr = lambda a, b: statistics.median([x / y for x, y in zip(rows[a], rows[b])])
    print(f"settle {SETTLE}: ms " + " ".join(f"{k} {v:.3f}" for k, v in med.items()) +
          f" | A/floor {pr('A','floor'):.3f} B/floor {pr('B','floor'):.3f} B/A {pr('B','A'):.3f}")
    A.close(); B.close()
