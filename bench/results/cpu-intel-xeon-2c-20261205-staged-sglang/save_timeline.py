# throwaway: where an in-place evict's time goes, by thread: marks in the Mooncake client's
# calls, the store's put/get, the mover's _take_call/_submit/_count, and around freeing the
# caller's page tensor (which releases the GIL). The vLLM bench's blocks (256 x 16 layers).
# PYTHONPATH=. .venv-vllm/bin/python <this>
import bench  # noqa
import time, statistics, threading, torch, kvmove, hashlib, uuid
from bench.bench_vllm import llama_like_cache
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.worker import block_mover, block_pages
T = []
def mark(name): T.append((name, time.perf_counter(), threading.current_thread().name))
class Proxy:
    def __init__(self, c): self._c = c
    def __getattr__(self, a):
        f = getattr(self._c, a)
        if not a.startswith("batch_"): return f
        def w(*args, **kw):
            mark(a + ">"); r = f(*args, **kw); mark(a + "<"); return r
        return w
n, bs, L = 256, 16, 16
src = llama_like_cache(L, 2 * n + 1, 8, bs, 64)
save_ids = list(range(2 * n - 1, 0, -2))[:n]
load_ids = [b - 1 for b in save_ids]
fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()
with kvmove.MooncakeStore.embedded(global_segment_size=4 << 30) as store:
    store._state.users[id(Proxy)] = 0
    p = Proxy(store._client); store._client = p
    views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], 2 * n + 1)
    mover = block_mover(views, store, staging_slots=n, path="in_place")
    for nm in ("put", "get"):
        f0 = getattr(store, nm)
        def w(*a, f0=f0, nm=nm, **k):
            mark("store." + nm + ">"); r = f0(*a, **k); mark("store." + nm + "<"); return r
        setattr(store, nm, w)
    tc0 = mover._take_call
    def tcw(*a, **k):
        mark("take>"); r = tc0(*a, **k); mark("take<"); return r
    mover._take_call = tcw
    sb0 = mover._submit
    def sbw(*a, **k):
        mark("submit>"); r = sb0(*a, **k); mark("submit<"); return r
    mover._submit = sbw
    import kvmove.mover as mm
    FE = mm.FutureEvent
    def few(f):
        mark("FE>"); r = FE(f); mark("FE<"); return r
    mm.FutureEvent = few
    import kvmove.transfer as tr
    ap0 = tr.Transfer.add_piece
    def apw(self, *a):
        mark("ap>"); ap0(self, *a); mark("ap<")
    tr.Transfer.add_piece = apw
    c0 = mover._count
    def cw(*a, **k):
        mark("count>"); r = c0(*a, **k); mark("count<"); return r
    mover._count = cw
    res = {}
    for r in range(12):
        k = fmt.keys(ns, [hashlib.sha256(uuid.uuid4().bytes).digest() for i in range(n)])
        T.clear(); mark("call")
        if r: del t
        mark("deleted")
        bp = block_pages(save_ids); mark("bp")
        t = mover.evict(k, bp); mark("returned0")
        del bp; mark("bp freed")
        for j in range(8):
            x = [q for q in range(100)]; mark(f"busy{j}")
        mark("returned")
        t.wait(); mark("waited")
        base = T[0][1]
        for name, ts, th in T: res.setdefault(("save", name, th), []).append((ts - base) * 1e3)
        T.clear(); mark("call")
        t = mover.prefetch(k, block_pages(load_ids)); mark("returned")
        t.wait(); mark("waited")
        base = T[0][1]
        for name, ts, th in T: res.setdefault(("load", name, th), []).append((ts - base) * 1e3)
    for key, v in res.items(): print(key, f"{statistics.median(v[2:]) if len(v) > 2 else -1:.3f} ms")
    mover.close()
