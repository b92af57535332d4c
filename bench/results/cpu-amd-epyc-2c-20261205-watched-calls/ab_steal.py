# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-watched-calls/ab_steal.py [repeats] [blocks] [layers]
# ab_watched.py with the prefetch's job also run by its caller (an unbounded wait: the
# caller takes the job over), each way with the get handed off or watched. Ran at 7b874a4;
# since 2b60f64 a job run on the main thread hands the get off whatever the option, so
# steal_watched now equals steal_hop
import bench  # noqa
import time, statistics, torch, kvmove, hashlib, uuid, threading, sys
import numpy as np
from bench.bench_vllm import llama_like_cache, transfer_thread
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
import kvmove.store.mooncake_store as MS
from kvmove.store.bounded_call import StartedCall
from concurrent.futures import Future
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
def inline_start(fn, *args, runner=None, on_return=None):
    f = Future(); f.set_result(fn(*args))
    if on_return is not None: on_return()
    return StartedCall(f, time.monotonic())
real = MS.start_call
n, bs, L = int(sys.argv[2]) if len(sys.argv) > 2 else 256, 16, int(sys.argv[3]) if len(sys.argv) > 3 else 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
a = torch.empty(32 << 20, dtype=torch.uint8); b = torch.empty_like(a)
thread = transfer_thread(bs)
vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vllm.register_kv_caches(src, nb)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).digest() for i in range(n)])
    assert mover.evict(k, block_pages(save_ids), detect_exists=False).wait() == [kvmove.Status.OK] * n
    client = store._client
    def vllm_load():
        addrs, sizes, _ = vllm.prepare_values(chunks, load_ids, [0] * n)
        res = client.batch_get_into_multi_buffers(k, addrs, sizes); assert all(r > 0 for r in res)
    def on_thread():
        done = threading.Event(); thread.add_request((vllm_load, done)); done.wait()
    def pf(opts, steal):
        def f():
            mover._in_place_get_options = opts
            t = mover.prefetch(k, block_pages(load_ids))
            if not steal: t.wait(timeout=600)
            assert t.wait() == [kvmove.Status.OK] * n; t.scattered.synchronize()
        return f
    fns = dict(vllm=on_thread, async_hop=pf({}, False), async_watched=pf({"until_returned": True}, False),
               steal_hop=pf({}, True), steal_watched=pf({"until_returned": True}, True))
    rows = {name: [] for name in fns}
    names = list(fns)
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 60):
        for name in names[r % len(names):] + names[:r % len(names)]:
            b.copy_(a)
            t0 = time.perf_counter(); fns[name](); dt = time.perf_counter() - t0
            if r >= 4: rows[name].append(dt)
    mover.close()
for name, v in rows.items():
    d = [x - y for x, y in zip(v, rows["vllm"])]
    print(f"{name:8s} median {statistics.median(v)*1e3:.3f} ms; over vllm, paired median {statistics.median(d)*1e6:.0f} us")
