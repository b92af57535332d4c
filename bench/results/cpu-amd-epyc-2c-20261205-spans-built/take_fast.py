# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/take_fast.py
# cold prefetch() return (gc.collect() before each), the in-place mover, 96 keys: _take_call as built against variants
import gc, time, statistics, uuid, sys
import numpy as np, torch
import kvmove, kvmove.mover as M
from kvmove.checks import check_keys, small_rows_ok, check_valid_tokens, INDEX_NUMPY_DTYPES
N = 96; L, row = 32, 16384
num_slots = 4 * N + 2
cache = torch.randint(0, 256, (L, num_slots, row), dtype=torch.uint8)
kv = kvmove.KVCache({"kv": cache})
g = torch.Generator().manual_seed(2)
slots = 2 * torch.randperm(num_slots // 2, generator=g)[:2 * N]
src, dst = slots[:N].reshape(N, 1), slots[N:].reshape(N, 1)
orig = M.KVMover._take_call
def fast(self, keys, token_pages, valid_tokens, *, gathering):
    if self._closed:
        raise M.KVMoveError("the KVMover is closed")
    keys = check_keys(keys)
    n = len(keys)
    host = token_pages.numpy() if type(token_pages) is torch.Tensor else token_pages
    if host.dtype not in INDEX_NUMPY_DTYPES or host.ndim != 2:
        raise TypeError
    if host.shape != (n, self.page_tokens):
        raise ValueError
    valid = check_valid_tokens(valid_tokens, n, self.page_tokens)
    host = host.astype(np.int64)
    if not small_rows_ok(host, self.kv.num_slots, unique=not gathering):
        raise ValueError
    return M.Call(keys, host, valid, None, None)
def nocheck(self, keys, token_pages, valid_tokens, *, gathering):
    return M.Call(list(keys), token_pages.numpy().astype(np.int64), check_valid_tokens(valid_tokens, len(keys), self.page_tokens), None, None)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    store.register([(cache.data_ptr(), cache.numel())])
    m = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=N, raw_keys=True, path="in_place")
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(N)]
    m.evict(keys, src).wait()
    variants = {"as built": orig, "fast host path": fast, "copy only (no checks)": nocheck}
    out = {k: [] for k in variants}
    for r in range(63):
        for name, fn in variants.items():
            M.KVMover._take_call = fn
            gc.collect()
            t0 = time.perf_counter(); t = m.prefetch(keys, dst); t1 = time.perf_counter()
            assert t.wait() == [kvmove.Status.OK] * N
            if r >= 3: out[name].append(t1 - t0)
    M.KVMover._take_call = orig
    for k, v in out.items():
        print(f"{k:24s} {statistics.median(v)*1e6:6.0f} us")
    m.close()
