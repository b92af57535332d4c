# throwaway: does a put of keys that exist move their bytes again? (Mooncake, loopback TCP)
import time, statistics, torch, kvmove, mooncake
from kvmove.store.config import StoreConfig
print("mooncake", getattr(mooncake, "__version__", "?"))
n, size = 256, 512 << 10
buf = torch.randint(0, 256, (n, size), dtype=torch.uint8)
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    store.register([(buf.data_ptr(), buf.nbytes)])
    client = store._client
    from mooncake.store import ReplicateConfig
    rc = ReplicateConfig()
    for rnd in range(3):
        keys = [f"k{rnd}-{i}" for i in range(n)]
        ptrs = [[buf[i].data_ptr()] for i in range(n)]
        sizes = [[size] for _ in range(n)]
        t0 = time.perf_counter(); r1 = client.batch_put_from_multi_buffers(keys, ptrs, sizes, rc); t1 = time.perf_counter()
        r2 = client.batch_put_from_multi_buffers(keys, ptrs, sizes, rc); t2 = time.perf_counter()
        t3 = time.perf_counter(); e = client.batch_is_exist(keys); t4 = time.perf_counter()
        print(f"first put {1e3*(t1-t0):.1f} ms (codes {set(r1)}), again {1e3*(t2-t1):.2f} ms (codes {set(r2)}), is_exist {1e3*(t4-t3):.2f} ms")
