# throwaway: a put of keys that exist, without the exists check: does Mooncake skip the transfer?
# PYTHONPATH=. .venv/bin/python <this>
import bench  # noqa
import time, statistics, torch, kvmove, uuid
from kvmove.store.config import StoreConfig
n, size = 256, 512 << 10
buf = torch.randint(0, 255, (n, size), dtype=torch.uint8)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    store.register([(buf.data_ptr(), buf.nbytes)])
    c = store._client
    res = {}
    for r in range(12):
        keys = [f"k{uuid.uuid4().hex}-{i}" for i in range(n)]
        ptrs = [[buf[i].data_ptr()] for i in range(n)]; sizes = [[size]] * n
        t0 = time.perf_counter(); a = c.batch_put_from_multi_buffers(keys, ptrs, sizes, store._replicate); t1 = time.perf_counter()
        b = c.batch_put_from_multi_buffers(keys, ptrs, sizes, store._replicate); t2 = time.perf_counter()
        e = c.batch_is_exist(keys); t3 = time.perf_counter()
        res.setdefault("new put", []).append(t1 - t0); res.setdefault("existing put", []).append(t2 - t1); res.setdefault("exists", []).append(t3 - t2)
        assert set(a) == {0} and set(b) == {0}, (set(a), set(b))
        store.remove(keys, force=True)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in res.items()})
