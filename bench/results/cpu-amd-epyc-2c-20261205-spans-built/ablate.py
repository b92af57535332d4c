# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/ablate.py
# cold prefetch() return time (gc.collect() before each) of the in-place mover, 96 keys x 32 layers, with pieces
# replaced by precomputed results (ablation): check_keys, the whole _take_call, and _take_call plus the job's queueing
import gc, time, statistics, uuid, sys, functools
import numpy as np, torch
import kvmove, kvmove.mover as M, kvmove.transfer as T
N = 96; L, row = 32, 16384
num_slots = 4 * N + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
g = torch.Generator().manual_seed(2)
slots = 2 * torch.randperm(num_slots // 2, generator=g)[:2 * N]
src, dst = slots[:N].reshape(N, 1), slots[N:].reshape(N, 1)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    store.register([(cache.data_ptr(), cache.numel())])
    m = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=N, raw_keys=True, path="in_place")
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(N)]
    m.evict(keys, src).wait()
    call = m._take_call(keys, dst, None, gathering=False)
    orig_take, orig_ck, orig_start = M.KVMover._take_call, M.check_keys, M.KVMover._start
    variants = {
        "as built": {},
        "no check_keys": {"ck": lambda k: list(k)},
        "no _take_call": {"take": lambda self, *a, **k: call},
        "no _take_call, no _start": {"take": lambda self, *a, **k: call, "start": lambda self, job: None},
    }
    out = {k: [] for k in variants}
    for r in range(63):
        for name, v in variants.items():
            M.check_keys = v.get("ck", orig_ck)
            M.KVMover._take_call = v.get("take", orig_take)
            M.KVMover._start = v.get("start", orig_start)
            gc.collect()
            t0 = time.perf_counter(); t = m.prefetch(keys, dst); t1 = time.perf_counter()
            M.KVMover._start = orig_start
            assert t.wait() == [kvmove.Status.OK] * N  # a job not queued is run here
            if r >= 3: out[name].append(t1 - t0)
    for k, v in out.items():
        print(f"{k:28s} {statistics.median(v)*1e6:6.0f} us")
    M.check_keys, M.KVMover._take_call = orig_ck, orig_take
    m.close()
