"""Throwaway: the first evict and prefetch of a freshly built KVMover against the next ones.
32 keys of one-token pages x 61 layers x 656 B (the hot path's prefetch shape); four rounds
of evict (new keys) + wait, then prefetch of those keys + wait. Prints, per round, the µs
until the call returned and until its wait() returned ("return/done"), and one line of
first / median of rounds 2-4. One process per configuration (run it once per config)."""
import statistics
import sys
import time

import torch

import kvmove
from bench.bench_hot_path import kv_cache

cache, path = sys.argv[1], sys.argv[2]
with kvmove.MooncakeStore.embedded() as store:
    kv = kv_cache(cache, 61, 1024, 656, torch.device("cpu"))
    t0 = time.perf_counter()
    mover = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="first",
                           path=path)
    build_ms = (time.perf_counter() - t0) * 1e3
    dest = torch.arange(512, 544).reshape(-1, 1)
    rounds = []
    for i in range(4):
        keys = [f"r{i}-{j}" for j in range(32)]
        t0 = time.perf_counter()
        t = mover.evict(keys, torch.arange(32).reshape(-1, 1))
        e_ret = time.perf_counter() - t0
        assert t.wait() == [kvmove.Status.OK] * 32
        e_done = time.perf_counter() - t0
        t0 = time.perf_counter()
        t = mover.prefetch(keys, dest)
        p_ret = time.perf_counter() - t0
        assert t.wait() == [kvmove.Status.OK] * 32
        p_done = time.perf_counter() - t0
        rounds.append([x * 1e6 for x in (e_ret, e_done, p_ret, p_done)])
    mover.close()
first, later = rounds[0], [statistics.median(r[k] for r in rounds[1:]) for k in range(4)]
names = ("evict return", "evict done", "prefetch return", "prefetch done")
print(f"{cache} {path} (picked {mover.path}), built in {build_ms:.0f} ms; first / later µs: "
      + ", ".join(f"{n} {f:.0f} / {v:.0f}" for n, f, v in zip(names, first, later)))
