# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-late/stage_times.py
# 32 keys of one-token pages x 61 layers x 656 B, per-layer tensors: the median get and scatter times (TransferResult.times)
# of 200 whole and 200 layer-wise prefetches, each waited at once.
import os, statistics, torch, kvmove
from bench.bench_hot_path import kv_cache
layers, keys_n, row_bytes = 61, 32, 656
with kvmove.MooncakeStore.embedded() as store:
    kv = kv_cache("per_layer", layers, 1024, row_bytes, torch.device("cpu"))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="hot") as mover:
        keys = [f"hot-{os.getpid()}-{i}" for i in range(keys_n)]
        assert mover.evict(keys, torch.arange(keys_n).reshape(-1, 1)).wait(60) == [kvmove.Status.OK] * keys_n
        dest = torch.arange(512, 512 + keys_n).reshape(-1, 1)
        for lw in (False, True):
            for _ in range(20): mover.prefetch(keys, dest, layerwise=lw).wait()
            res = [mover.prefetch(keys, dest, layerwise=lw).result() for _ in range(200)]
            print("layer-wise" if lw else "whole", "get us", statistics.median(r.times.get for r in res)*1e6, "scatter us", statistics.median(r.times.scatter for r in res)*1e6)
