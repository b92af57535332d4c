# throwaway: .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/get_main_or_worker.py 40 <mode>
# the raw Mooncake get of bench_in_place's block rows (96 keys x 32 spans of 16 KiB), from the main thread and from a worker
# thread (hand-off included), alternating; before each: mode 0 nothing, 1 gc.collect() on the main thread, 2 gc.collect() on
# the worker thread, or (mode >= 3) gc.collect() on the main thread then a sleep of mode ms
import time, statistics, threading, queue, sys, gc
import torch, numpy as np
import kvmove
n, L, row = 96, 32, 16384
GC = int(sys.argv[2])
nb = 2 * n + 1
kv = torch.zeros(L, nb, row, dtype=torch.uint8)
kv.random_(0, 255)
base = kv.data_ptr()
ids = list(range(1, 2 * n, 2))
ptrs = [[base + (l * nb + b) * row for l in range(L)] for b in ids]
sizes = [[row] * L for _ in ids]
q = queue.SimpleQueue(); out = queue.SimpleQueue()
def worker():
    while True:
        fn = q.get(); out.put(fn())
threading.Thread(target=worker, daemon=True).start()
with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
    c = store._client
    store.register([(kv.data_ptr(), kv.numel())])
    keys = [f"k{i}" for i in range(n)]
    assert all(r == 0 for r in c.batch_put_from_multi_buffers(keys, ptrs, sizes, __import__("mooncake.store", fromlist=["ReplicateConfig"]).ReplicateConfig()))
    rows = {"main": [], "worker": []}
    for r in range(int(sys.argv[1])):
        for who in (("main", "worker") if r % 2 else ("worker", "main")):
            (q.put(gc.collect), out.get()) if GC == 2 else (GC and gc.collect(), GC >= 3 and time.sleep(GC / 1000))
            t0 = time.perf_counter()
            if who == "main":
                res = c.batch_get_into_multi_buffers(keys, ptrs, sizes)
            else:
                q.put(lambda: c.batch_get_into_multi_buffers(keys, ptrs, sizes)); res = out.get()
            rows[who].append(time.perf_counter() - t0)
            assert res == [L * row] * n
    m = {k: statistics.median(v) for k, v in rows.items()}
    ratio = statistics.median([w / x for w, x in zip(rows["worker"], rows["main"])])
    print({k: round(v * 1e3, 3) for k, v in m.items()}, "worker/main paired", round(ratio, 3))
