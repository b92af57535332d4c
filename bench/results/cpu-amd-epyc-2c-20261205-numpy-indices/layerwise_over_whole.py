# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-numpy-indices/layerwise_over_whole.py
# bench_hot_path's prefetches(): layer-wise over whole prefetch, stacked and per-layer caches, 3 rounds
import bench  # noqa
import kvmove, torch, sys
from bench.bench_hot_path import prefetches
with kvmove.MooncakeStore.embedded() as store:
    for i in range(3):
        for cache in ("stacked", "per_layer"):
            r = prefetches(store, 41, cache=cache)
            print(cache, round(r["whole_us"]), round(r["layerwise_us"]), round(r["layerwise_over_whole"], 3))
