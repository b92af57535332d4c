"""Throwaway: where the first staged evict of a fresh KVMover spends its time (each stage timed by wrapping the mover's methods), against the second (32 keys of one-token pages x 61 layers x 656 B)."""
import time, torch, kvmove, sys
from bench.bench_hot_path import kv_cache
acc=[]
def wrap(obj, name):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: acc.append((name, round((time.perf_counter()-t0)*1e6)))
    setattr(obj, name, g)
with kvmove.MooncakeStore.embedded() as store:
    kv = kv_cache("stacked", 61, 1024, 656, torch.device("cpu"))
    m = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="f", path="staged")
    for n in ("_describe", "_put_job", "_run_gather", "_begin_put"): wrap(m, n)
    wrap(store, "put")
    for i in range(2):
        keys = [f"r{i}-{j}" for j in range(32)]
        t0 = time.perf_counter(); t = m.evict(keys, torch.arange(32).reshape(-1, 1)); t.wait()
        print(round((time.perf_counter()-t0)*1e6), acc); acc.clear()
    m.close()
