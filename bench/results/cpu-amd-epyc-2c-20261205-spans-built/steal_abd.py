# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/steal_abd.py 40 gc|rest|busy
# in-place block-row get (bench_in_place's shape), paired against the floor (raw get on main). Before every call:
# gc.collect(), then per MODE: "gc" nothing more, "rest" sleep 20 ms, "busy" ~1 ms of Python work (an engine step).
# A: as built (the main thread steals the job and hands the native get to a runner thread);
# D: the main thread steals and makes the native get itself (watched); B: the main thread never steals.
import sys, time, gc, uuid, statistics, threading as _th
import numpy as np, torch
import kvmove
import kvmove.mover as M
import kvmove.transfer as T
from bench.bench_in_place import workload_pages, floor_spans
REPS = int(sys.argv[1]); MODE = sys.argv[2]
POL = ["A"]
class Shim:
    def __getattr__(s, n): return getattr(_th, n)
    def main_thread(s): return None if POL[0] == "D" else _th.main_thread()
M.threading = Shim()
orig_steal = T.StealableJob.steal
def steal(self):
    if POL[0] == "B": return
    orig_steal(self)
T.StealableJob.steal = steal
L, row, pages = 32, 16384, 96
num_slots = 4 * pages + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
src, dst = workload_pages(pages, 1, num_slots, seed=2)
obj = L * row
junk = [list(range(50)) for _ in range(2000)]
def before():
    gc.collect()
    if MODE == "rest": time.sleep(0.02)
    elif MODE == "busy":
        t = time.perf_counter()
        while time.perf_counter() - t < 1e-3:
            sum(len(x) for x in junk[:200]); [str(i) for i in range(100)]
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
    ops = {"floor": floor, "A": mv("A"), "D": mv("D"), "B": mv("B")}
    rows = {k: [] for k in ops}
    names = list(ops)
    for r in range(REPS + 3):
        k = r % len(names)
        for who in names[k:] + names[:k]:
            before()
            t0 = time.perf_counter(); ops[who](); dt = time.perf_counter() - t0
            if r >= 3: rows[who].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    pr = lambda a, b: statistics.median([x / y for x, y in zip(rows[a], rows[b])])
    print(f"{MODE}: ms " + " ".join(f"{k} {v:.3f}" for k, v in med.items()) +
          " | " + " ".join(f"{p}/floor {pr(p, 'floor'):.3f}" for p in "ADB") +
          f" | D/A {pr('D','A'):.3f} B/A {pr('B','A'):.3f}")
    m.close()
