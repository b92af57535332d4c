# throwaway: bench_sglang's 32 x 16 end to end, each backend's Mooncake calls timed on its own
# client: is a gap in kvmove's own Python or in the native calls? argv: repeats
# PYTHONPATH=. .venv-sglang/bin/python <this> 16
import sys, time, statistics
import bench.bench_sglang as bs
T = {}
PHASE = ['?']
class Proxy:
    def __init__(self, c, tag): self._c, self._tag = c, tag
    def __getattr__(self, a):
        f = getattr(self._c, a)
        if not a.startswith("batch_"):
            return f
        def w(*args, **kw):
            t0 = time.perf_counter(); r = f(*args, **kw)
            T.setdefault(f"{PHASE[0]} {self._tag} {a}", []).append(time.perf_counter() - t0); return r
        return w
make0 = bs.make_backends
def make(model, page_first):
    sglang, ours = make0(model, page_first)
    PHASE[0] = ('page_first' if page_first else 'layer_first') + (' describe' if 'describe' in model else '')
    sglang.store = Proxy(sglang.store, "sglang")
    s = ours.store; real = s._client; p = Proxy(real, "kvmove")
    with s._lock:
        s._budgets[id(p)] = s._budgets[id(real)]; s._client = s._state.client = p
    return sglang, ours
bs.make_backends = make
rep = sys.argv[1] if len(sys.argv) > 1 else "20"
bs.main(["--pages", "8", "--e2e-cases", "32x16", "--e2e-repeat", rep])
for k, v in sorted(T.items()):
    print(k, len(v), f"{statistics.median(v[2:] or v) * 1e3:.2f} ms")
