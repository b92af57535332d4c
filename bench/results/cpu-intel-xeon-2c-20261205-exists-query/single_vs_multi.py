# throwaway: Mooncake's single-buffer calls (batch_put_from / batch_get_into) against the
# multi-buffer ones with one span per key, same keys and memory, alternating; objects held by
# a second client's segment (as bench_sglang). argv: keys, bytes per key, repeats
# PYTHONPATH=. .venv/bin/python <this> 32 1048576 24
import bench  # noqa
import sys, time, statistics, uuid, torch, kvmove
from kvmove.store.embedded_master import EmbeddedMaster
n, size, reps = (int(a) for a in (sys.argv[1:] + ["32", str(1 << 20), "20"])[:3])
src = torch.randint(0, 255, (n, size), dtype=torch.uint8); dst = torch.zeros_like(src)
with EmbeddedMaster() as master:
    holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=2 << 30))
    store = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=0))
    store.register([(src.data_ptr(), src.nbytes), (dst.data_ptr(), dst.nbytes)])
    c, rep = store._client, store._replicate
    sp = [src[i].data_ptr() for i in range(n)]; dp = [dst[i].data_ptr() for i in range(n)]
    res = {k: [] for k in ("put single", "put multi", "get single", "get multi")}
    for r in range(reps):
        for how in (("single", "multi") if r % 2 else ("multi", "single")):
            keys = [f"svm-{uuid.uuid4().hex}" for _ in range(n)]
            t0 = time.perf_counter()
            if how == "single":
                out = c.batch_put_from(keys, sp, [size] * n, rep)
            else:
                out = c.batch_put_from_multi_buffers(keys, [[p] for p in sp], [[size]] * n, rep)
            t1 = time.perf_counter()
            assert set(out) == {0}, out[:3]
            if how == "single":
                got = c.batch_get_into(keys, dp, [size] * n)
            else:
                got = c.batch_get_into_multi_buffers(keys, [[p] for p in dp], [[size]] * n)
            t2 = time.perf_counter()
            assert got == [size] * n
            res[f"put {how}"].append(t1 - t0); res[f"get {how}"].append(t2 - t1)
            holder.remove(keys, force=True)
    print(n, size, {k: round(statistics.median(v) * 1e3, 2) for k, v in res.items()})
    for op in ("put", "get"):
        pr = [a / b for a, b in zip(res[f"{op} multi"], res[f"{op} single"])]
        print(op, "multi/single paired median", round(statistics.median(pr), 3), "quartiles", [round(q, 3) for q in statistics.quantiles(pr, n=4)])
    store.close(); holder.close()
