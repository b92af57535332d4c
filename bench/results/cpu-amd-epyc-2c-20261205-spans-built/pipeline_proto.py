# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/pipeline_proto.py token|block 1,2,3,4
# prototype: a staged prefetch's get and scatter one after the other (as built) vs chunked and pipelined (the get of
# chunk k+1 on a helper thread while this thread scatters chunk k); real store, bench_in_place's workloads
import sys, time, gc, uuid, statistics
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch
import kvmove
from kvmove.transfer import LayerProgress
from bench.bench_in_place import workload_pages
WL = sys.argv[1]; CHUNKS = [int(c) for c in sys.argv[2].split(",")]; REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
L, row, pt, pages = (32, 16384, 1, 96) if WL == "block" else (61, 656, 16, 48)
num_slots = 4 * pages * pt + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, pt, num_slots, seed=2)
helper = ThreadPoolExecutor(1)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    m = kvmove.KVMover(kv, store, page_tokens=pt, staging_slots=pages, raw_keys=True, path="staged")
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    assert m.evict(keys, src).wait() == [kvmove.Status.OK] * pages
    want = cache[:, src.reshape(-1)].clone()
    def run(chunks):
        call = m._take_call(keys, dst, None, gathering=False)
        slots = m.staging.alloc(pages)
        prog = LayerProgress(L)
        edges = [pages * k // chunks for k in range(chunks + 1)]
        def get(k):
            a, b = edges[k], edges[k + 1]
            p = call.piece(a, b)
            desc = m._describe(slots[a:b], m.keyspace.store_keys(p.keys), p.valid)
            return m._store_call(m.store.get, desc)
        nxt = get(0) if chunks == 1 else None
        fut = helper.submit(get, 0) if chunks > 1 else None
        for k in range(chunks):
            st = nxt if chunks == 1 else fut.result()
            if k + 1 < chunks:
                fut = helper.submit(get, k + 1)
            ok = np.fromiter((s is kvmove.Status.OK for s in st[0]), dtype=bool)
            assert ok.all()
            a, b = edges[k], edges[k + 1]
            m._scatter(call.piece(a, b), slots[a:b], ok, False, prog, None)
        m.staging.free(slots)
    rows = {c: [] for c in CHUNKS}
    for r in range(REPS + 2):
        for c in (CHUNKS[r % len(CHUNKS):] + CHUNKS[:r % len(CHUNKS)]):
            cache[:, dst.reshape(-1)] = 0
            gc.collect()
            t0 = time.perf_counter(); run(c); dt = time.perf_counter() - t0
            assert torch.equal(cache[:, dst.reshape(-1)], want)
            if r >= 2: rows[c].append(dt)
    base = CHUNKS[0]
    print(WL, " ".join(f"{c} chunks {statistics.median(v)*1e3:.2f} ms ({statistics.median([x/y for x, y in zip(v, rows[base])]):.3f}x)" for c, v in rows.items()))
    m.close()
