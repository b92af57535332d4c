# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/evict_times.py <settle seconds> token|block
# staged evict + wait (token rows: 48 pages x 16 tokens x 61 layers x 656 B; or block rows), at rest or after gc: as built
# (the put job on a put worker) against the put job run by the waiting caller (not queued), alternating
import sys, time, gc, uuid, statistics
from concurrent.futures import Future
import numpy as np, torch
import kvmove, kvmove.mover as MV
from bench.bench_in_place import workload_pages
SETTLE = float(sys.argv[1]); WL = sys.argv[2] if len(sys.argv) > 2 else "token"
L, row, pt, pages = (61, 656, 16, 48) if WL == "token" else (32, 16384, 1, 96)
num_slots = 4 * pages * pt + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, pt, num_slots, seed=2)
real_submit = MV.KVMover._submit
def deferred(self, fn, *a, executor=None):
    if executor is None:
        return real_submit(self, fn, *a)
    f = Future(); f._job = (fn, a); return f
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    m = kvmove.KVMover(kv, store, page_tokens=pt, staging_slots=pages, raw_keys=True, path="staged")
    rows = {"worker": [], "caller": []}
    for r in range(33):
        for who in (("worker", "caller") if r % 2 else ("caller", "worker")):
            keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
            gc.collect(); time.sleep(SETTLE)
            if who == "caller":
                MV.KVMover._submit = deferred
            t0 = time.perf_counter(); t = m.evict(keys, src)
            MV.KVMover._submit = real_submit
            if who == "caller":
                f = t._pieces[0][1]; fn, a = f._job; f.set_result(fn(*a))
            st = t.wait(); dt = time.perf_counter() - t0
            assert st == [kvmove.Status.OK] * pages
            store.remove(keys, force=True)
            if r >= 3: rows[who].append(dt)
    md = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    pr = statistics.median([a / b for a, b in zip(rows["caller"], rows["worker"])])
    print(f"{WL}, settle {SETTLE}: evict+wait on a worker {md['worker']:.2f} ms, by the caller {md['caller']:.2f} ms, paired caller/worker {pr:.3f}")
    m.close()
