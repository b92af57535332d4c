# throwaway: where a GPU prefetch's host time goes (returns, layer-wise vs whole)
import cProfile, io, os, pstats, time, torch, kvmove
from bench.bench_hot_path import kv_cache
dev = torch.device(os.environ.get("DEV", "cuda"))
with kvmove.MooncakeStore.embedded() as store:
    for cache in ("stacked", "per_layer"):
        kv = kv_cache(cache, 61, 1024, 656, dev)
        with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="p") as m:
            keys = [f"k{cache}{i}" for i in range(32)]
            assert m.evict(keys, torch.arange(32).reshape(-1, 1)).wait(60) == [kvmove.Status.OK] * 32
            dest = torch.arange(512, 544).reshape(-1, 1)
            for lw in (False, True):
                ret, done = [], []
                for i in range(30):
                    t0 = time.perf_counter(); t = m.prefetch(keys, dest, layerwise=lw)
                    ret.append(time.perf_counter() - t0); t.wait(); (t.scattered.synchronize() if dev.type == "cuda" else None)
                    done.append(time.perf_counter() - t0)
                ret.sort(); done.sort()
                print(f"==== {cache} layerwise={lw}: return {ret[15]*1e6:.0f} us, done {done[15]*1e6:.0f} us")
                pr = cProfile.Profile()
                for i in range(10):
                    pr.enable(); t = m.prefetch(keys, dest, layerwise=lw); pr.disable()
                    t.wait(); (t.scattered.synchronize() if dev.type == "cuda" else None)
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
                print(s.getvalue()[-5000:])
                # the whole thing to the end, every thread
                pr = cProfile.Profile(); pr.enable()
                for i in range(10):
                    t = m.prefetch(keys, dest, layerwise=lw); t.wait(); (t.scattered.synchronize() if dev.type == "cuda" else None)
                pr.disable()
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
                print("---- to the end (caller thread), by cumtime"); print(s.getvalue()[-6000:])
