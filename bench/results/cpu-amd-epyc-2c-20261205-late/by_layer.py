# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-late/by_layer.py
# 32 keys of one-token pages x 61 layers x 656 B (bench_calls' prefetch shape): a whole prefetch, a layer-wise one waited
# with wait(), and a layer-wise one waited layer by layer with wait_layer(l) back to back (no engine work between), to
# the end; and when wait_layer(0) returned. Medians of 15 interleaved repeats, microseconds.
import os, statistics, time, sys
from bench.bench_hot_path import kv_cache
import torch, kvmove
layers, keys_n, row_bytes = 61, 32, 656
with kvmove.MooncakeStore.embedded() as store:
  for cache in ("stacked", "per_layer"):
    kv = kv_cache(cache, layers, 1024, row_bytes, torch.device("cpu"))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="hot") as mover:
        keys = [f"hot-{os.getpid()}-{cache}-{i}" for i in range(keys_n)]
        assert mover.evict(keys, torch.arange(keys_n).reshape(-1, 1)).wait(60) == [kvmove.Status.OK] * keys_n
        dest = torch.arange(512, 512 + keys_n).reshape(-1, 1)
        s = {m: [] for m in ("whole", "layerwise", "bylayer")}
        first = []
        for _ in range(15):
            for mode in s:
                t0 = time.perf_counter()
                t = mover.prefetch(keys, dest, layerwise=mode != "whole")
                if mode == "bylayer":
                    for l in range(layers):
                        t.wait_layer(l)
                        if l == 0: first.append(time.perf_counter() - t0)
                st = t.wait(); t.scattered.synchronize()
                s[mode].append(time.perf_counter() - t0)
        m = {k: statistics.median(v) * 1e6 for k, v in s.items()}
        print(cache, {k: round(v) for k, v in m.items()}, "first layer", round(statistics.median(first) * 1e6),
              "layerwise/whole %.2f bylayer/whole %.2f" % (m["layerwise"] / m["whole"], m["bylayer"] / m["whole"]))
