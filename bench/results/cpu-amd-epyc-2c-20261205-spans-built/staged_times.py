# throwaway: PYTHONPATH=<tree> .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/staged_times.py <settle seconds, or spin<seconds>> ["as built"|1] [noqueue]
# token rows (bench_in_place's second workload), staged prefetch at rest or after gc: the get and scatter stage times
import sys, time, gc, uuid, statistics
import numpy as np, torch
import kvmove
from bench.bench_in_place import workload_pages, floor_spans
SPIN = sys.argv[1].startswith('spin'); SETTLE = float(sys.argv[1].removeprefix('spin')); THREADS = sys.argv[2] if len(sys.argv) > 2 else "as built"
import kvmove.rows.torch_backend as TB
VARIANT = sys.argv[3] if len(sys.argv) > 3 else ""
import kvmove.mover as MV
if VARIANT == "noqueue":  # the job is not queued: no worker woken; the waiter runs it
    MV.KVMover._submit_orig = MV.KVMover._submit
if THREADS != "as built":
    n = int(THREADS); orig = TB.threads_for
    TB.threads_for = lambda b, l: min(n, orig(b, l)) if orig(b, l) else 0
L, row, pt, pages = 61, 656, 16, 48
num_slots = 4 * pages * pt + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, pt, num_slots, seed=2)
def rest():
    if SPIN:
        t = time.perf_counter()
        while time.perf_counter() - t < SETTLE: pass
    elif SETTLE:
        time.sleep(SETTLE)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    client = store._client
    store.register([(cache.data_ptr(), cache.numel())])
    m = kvmove.KVMover(kv, store, page_tokens=pt, staging_slots=pages, raw_keys=True, path="staged")
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    assert m.evict(keys, src).wait() == [kvmove.Status.OK] * pages
    sp = floor_spans(cache, dst); sizes = [[row] * (L * pt)] * pages
    g, s, tot, fl = [], [], [], []
    for r in range(33):
        gc.collect(); rest()
        if VARIANT == "noqueue":
            from concurrent.futures import Future
            def sub(self, fn, *a, executor=None):
                f = Future(); f._job = (fn, a); return f
            MV.KVMover._submit = sub
        t0 = time.perf_counter(); t = m.prefetch(keys, dst)
        if VARIANT == "noqueue":
            MV.KVMover._submit = MV.KVMover._submit_orig
            f = t._pieces[0][1]; fn, a = f._job; f.set_result(fn(*a))
        res = t.result(); dt = time.perf_counter() - t0
        gc.collect(); rest()
        t1 = time.perf_counter(); client.batch_get_into_multi_buffers(keys, sp, sizes); f = time.perf_counter() - t1
        if r >= 3: g.append(res.times.get); s.append(res.times.scatter); tot.append(dt); fl.append(f)
    md = lambda v: statistics.median(v) * 1e3
    print(f"threads {THREADS} {VARIANT}, {sys.argv[1]}: staged prefetch {md(tot):.2f} ms = get {md(g):.2f} + scatter {md(s):.2f} (+ rest); floor (976 spans/key) {md(fl):.2f} ms")
    m.close()
