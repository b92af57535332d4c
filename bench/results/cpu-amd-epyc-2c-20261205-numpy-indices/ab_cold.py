# throwaway (run by ab_cold.sh): in one process, the vLLM connector's in-place load and save by
# kvmove_a (a revision) and kvmove_b (the working tree), both copies renamed by mkpkg.sh, and
# vLLM's own path; native calls faked by a 128 MiB copy (as the real call flushes the
# caches); per repeat, the time outside the fake call; medians, and paired medians against
# vLLM and between the two. argv: repeats, which copy is set up first (a/b).
import bench  # noqa
import time, statistics, torch, hashlib, uuid, sys, threading, contextlib
import numpy as np
import kvmove_a, kvmove_b
FIRST = sys.argv[2] if len(sys.argv) > 2 else 'a'
from bench.bench_vllm import llama_like_cache, transfer_thread
n, bs, L = 256, 16, 16
nb = 2 * n + 1
src = llama_like_cache(L, nb, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
a = torch.empty(128 << 20, dtype=torch.uint8); b = torch.empty_like(a); a.fill_(1)
size = L * 8 * bs * 128 * 2
NAT = [0.0]
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
keys = ["bench-llama@tp0@pp0@" + hashlib.sha256(uuid.uuid4().bytes + bytes([i % 256, i // 256])).hexdigest() for i in range(n)]

def fake_client(real):
    class Fake:
        def __getattr__(self, name): return getattr(real, name)
        def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
            t0 = time.perf_counter(); b.copy_(a); NAT[0] += time.perf_counter() - t0
            return [size] * len(keys)
        def batch_put_from_multi_buffers(self, keys, ptrs, sizes, *cfg):
            t0 = time.perf_counter(); b.copy_(a); NAT[0] += time.perf_counter() - t0
            return [0] * len(keys)
    return Fake()

def setup(pkg, stack):
    from importlib import import_module
    W = import_module(pkg.__name__ + ".integrations.vllm.worker")
    LY = import_module(pkg.__name__ + ".integrations.vllm.layout")
    store = stack.enter_context(pkg.MooncakeStore.embedded(global_segment_size=256 << 20))
    views, _ = LY.block_regions([(f"l{i}", t) for i, t in enumerate(src)], nb)
    mover = W.block_mover(views, store, staging_slots=n, path="in_place")
    stack.callback(mover.close)
    real = store._client
    fake = fake_client(real)
    store._client = store._state.client = fake
    store._budgets[id(fake)] = store._budgets[id(real)]; store._state.users[id(fake)] = 0
    def restore():
        store._client = store._state.client = real
    stack.callback(restore)
    OK = [pkg.Status.OK] * n
    def load(ret, tag):
        t0 = time.perf_counter()
        t = mover.prefetch(keys, W.block_pages(load_ids))
        ret[tag + " load returns"] = time.perf_counter() - t0
        t.wait(timeout=600)
        assert t.wait() == OK
        t.scattered.synchronize()
    def save(ret, tag):
        t0 = time.perf_counter()
        t = mover.evict(keys, W.block_pages(save_ids), detect_exists=False)
        ret[tag + " save returns"] = time.perf_counter() - t0
        assert t.wait() == OK
    return load, save

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import KeyMetadata, RankLocalStoreLayout
from mooncake.store import ReplicateConfig
vl = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
vl.register_kv_caches(src, nb)
chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
thread = transfer_thread(bs)
rc = ReplicateConfig()
with contextlib.ExitStack() as stack:
    ops = {}
    pk = {"before": kvmove_a, "after": kvmove_b}
    for side in (("before", "after") if FIRST == "a" else ("after", "before")):
        ops[side] = setup(pk[side], stack)
    ops = {k: ops[k] for k in ("before", "after")}
    vfake = fake_client(None)
    def vllm_load(ret, tag):
        def call():
            addrs, sizes, _ = vl.prepare_values(chunks, load_ids, [0] * n)
            assert vfake.batch_get_into_multi_buffers(keys, addrs, sizes) == [size] * n
        on_thread(call, ret, tag + " load returns")
    def vllm_save(ret, tag):
        def call():
            addrs, sizes, _ = vl.prepare_values(chunks, save_ids, [0] * n)
            assert all(r == 0 for r in vfake.batch_put_from_multi_buffers(keys, addrs, sizes, rc))
        on_thread(call, ret, tag + " save returns")
    def on_thread(call, ret, tag):
        done = threading.Event()
        t0 = time.perf_counter()
        thread.add_request((call, done))
        ret[tag] = time.perf_counter() - t0
        done.wait()
    ops["vLLM"] = (vllm_load, vllm_save)
    rows = {}
    sides = list(ops)
    for r in range(REPS):
        order = sides[r % 3:] + sides[:r % 3]
        for op in (0, 1):
            for side in order:
                ret = {}
                b.copy_(a)
                NAT[0] = 0.0
                t0 = time.perf_counter(); ops[side][op](ret, side); dt = time.perf_counter() - t0
                if r >= 5:
                    rows.setdefault(f"{side} {('load', 'save')[op]}", []).append(dt - NAT[0])
                    for x, v in ret.items(): rows.setdefault(x, []).append(v)
    for op in ("load", "save"):
        line = [f"{op:4s} outside:"]
        for side in sides:
            line.append(f"{side} {statistics.median(rows[f'{side} {op}'])*1e6:5.0f}")
        for side in ("before", "after"):
            d = [x - y for x, y in zip(rows[f"{side} {op}"], rows[f"vLLM {op}"])]
            line.append(f"| {side}-vLLM {statistics.median(d)*1e6:4.0f}")
        d = [x - y for x, y in zip(rows[f"after {op}"], rows[f"before {op}"])]
        line.append(f"| after-before {statistics.median(d)*1e6:4.0f}")
        line.append("| returns " + " ".join(f"{s} {statistics.median(rows[f'{s} {op} returns'])*1e6:.0f}" for s in sides))
        print("  ".join(line))
