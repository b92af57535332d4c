# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-late/wakes.py 60 gc|rest
# In-place block-row get (bench_in_place's shape: 96 keys x 32 layers x 16 KiB), paired against the floor (the raw
# get on the main thread). Before every call gc.collect(), then (rest) a 20-ms sleep. Which thread wake-ups cost:
# A: as built (the job queued, waking a worker; the waiting main thread runs it and hands the native call to a runner);
# A0: the job not queued (no worker woken; the waiter runs it, the native call on a runner);
# D0: not queued, and the native call made on the main thread itself (watched): no thread woken at all.
import sys, time, gc, uuid, statistics, threading as _th
import torch
import kvmove
import kvmove.mover as M
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); MODE = sys.argv[2]
POL = ["A"]
class Shim:
    def __getattr__(s, n): return getattr(_th, n)
    def main_thread(s): return None if POL[0] == "D0" else _th.main_thread()
M.threading = Shim()
real_start = M.KVMover._start
def start(self, job):
    if POL[0] == "A":
        real_start(self, job)
M.KVMover._start = start
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
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)]
    assert all(c == 0 for c in client.batch_put_from_multi_buffers(keys, src_spans, sizes))
    def floor():
        assert client.batch_get_into_multi_buffers(keys, dst_spans, sizes) == [obj] * pages
    def mv(p):
        def f():
            POL[0] = p
            assert m.prefetch(keys, dst).wait() == [kvmove.Status.OK] * pages
        return f
    ops = {"floor": floor, "A": mv("A"), "A0": mv("A0"), "D0": mv("D0")}
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
          " | " + " ".join(f"{p}/floor {pr(p, 'floor'):.3f}" for p in ("A", "A0", "D0")) +
          f" | A0/A {pr('A0','A'):.3f} D0/A {pr('D0','A'):.3f}")
    m.close()
