# throwaway: one get of 256 keys (16 spans of 32 KiB each) against two gets of 128 side by side
# PYTHONPATH=. .venv/bin/python <this>
import bench  # noqa
import time, statistics, threading, torch, kvmove, uuid
n, spans, size = 256, 16, 32 << 10
src = torch.randint(0, 255, (n * spans, size), dtype=torch.uint8)
dst = torch.zeros_like(src)
with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
    store.register([(src.data_ptr(), src.nbytes), (dst.data_ptr(), dst.nbytes)])
    c = store._client
    keys = [f"sb-{uuid.uuid4().hex}-{i}" for i in range(n)]
    perm = torch.randperm(n * spans).tolist()
    sp = [[src[perm[i * spans + j]].data_ptr() for j in range(spans)] for i in range(n)]
    dp = [[dst[perm[i * spans + j]].data_ptr() for j in range(spans)] for i in range(n)]
    sz = [[size] * spans for _ in range(n)]
    assert set(c.batch_put_from_multi_buffers(keys, sp, sz, store._replicate)) == {0}
    def one():
        r = c.batch_get_into_multi_buffers(keys, dp, sz); assert r == [size * spans] * n
    def two():
        h = n // 2; out = {}
        t = threading.Thread(target=lambda: out.setdefault(0, c.batch_get_into_multi_buffers(keys[:h], dp[:h], sz[:h])))
        t.start(); out[1] = c.batch_get_into_multi_buffers(keys[h:], dp[h:], sz[h:]); t.join()
    res = {"one": [], "two": []}
    for r in range(16):
        for name, f in (("one", one), ("two", two)) if r % 2 else (("two", two), ("one", one)):
            t0 = time.perf_counter(); f(); res[name].append(time.perf_counter() - t0)
    print({k: round(statistics.median(v) * 1e3, 2) for k, v in res.items()})
    print("paired two/one", round(statistics.median([a / b for a, b in zip(res["two"], res["one"])]), 3))
