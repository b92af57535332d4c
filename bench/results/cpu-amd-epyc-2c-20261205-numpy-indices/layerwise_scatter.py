# throwaway: PYTHONPATH=. .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-numpy-indices/layerwise_scatter.py
# the staged scatter of 32 one-token pages x 61 layers: whole, layer by layer with and without
# LayerProgress; then a cProfile of the layer-by-layer loop
import bench  # noqa
import kvmove, torch, time, statistics
from bench.bench_hot_path import kv_cache
from kvmove.rows.moves import plan_pages, run_pages
from kvmove.transfer import LayerProgress
with kvmove.MooncakeStore.embedded() as store:
  for cache in ("stacked", "per_layer"):
    kv = kv_cache(cache, 61, 1024, 656, torch.device("cpu"))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="hot", path="staged") as m:
        slots = torch.arange(32)
        pages = torch.arange(512, 544).reshape(-1, 1)
        def whole():
            plan = plan_pages(m._scatter_all, pages, slots)
            run_pages(m._scatter_all, plan, None)
        def layerwise():
            plan = plan_pages(m._scatter_all, pages, slots)
            p = LayerProgress(61)
            for prep in m._scatter_layer:
                run_pages(prep, plan, None)
                p.layer_done(None)
        def layerwise_noprog():
            plan = plan_pages(m._scatter_all, pages, slots)
            for prep in m._scatter_layer:
                run_pages(prep, plan, None)
        fns = {"whole": whole, "layerwise": layerwise, "layerwise no progress": layerwise_noprog}
        rows = {k: [] for k in fns}
        for r in range(300):
            for k, f in fns.items():
                t0 = time.perf_counter(); f(); rows[k].append(time.perf_counter() - t0)
        print(cache, {k: round(statistics.median(v) * 1e6, 1) for k, v in rows.items()})
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for r in range(200): layerwise_noprog()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
