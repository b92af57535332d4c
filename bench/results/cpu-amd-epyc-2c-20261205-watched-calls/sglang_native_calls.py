# throwaway: PYTHONPATH=. .venv-sglang/bin/python bench/results/cpu-amd-epyc-2c-20261205-watched-calls/sglang_native_calls.py [repeats]
# bench_sglang's end-to-end page_first 32 x 16 case with each backend's Mooncake calls timed
import sys, time, statistics, os, argparse
import bench.bench_sglang as B
import kvmove
T = {}
class Proxy:
    def __init__(self, real, tag):
        self._real, self._tag = real, tag
        for nm in ("batch_is_exist", "batch_put_from_multi_buffers", "batch_get_into_multi_buffers", "batch_put_from", "batch_get_into"):
            setattr(self, nm, self._wrap(nm))
    def _wrap(self, nm):
        fn = getattr(self._real, nm)
        def w(*a):
            t0 = time.perf_counter(); r = fn(*a); T.setdefault((self._tag, nm), []).append(time.perf_counter() - t0); return r
        w.__name__ = nm; w.__self__ = self
        return w
    def __getattr__(self, n): return getattr(self._real, n)
orig = B.make_backends
def make_backends(model, page_first):
    s, o = orig(model, page_first)
    s.store = Proxy(s.store, "sglang")
    st = o.store; real = st._client; p = Proxy(real, "kvmove")
    st._budgets[id(p)] = st._budgets[id(real)]; st._state.users[id(p)] = 0
    st._client = st._state.client = p
    return s, o
B.make_backends = make_backends
master = kvmove.EmbeddedMaster()
holder = kvmove.MooncakeStore(kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1", global_segment_size=2 << 30))
os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
args = argparse.Namespace(layers=61, e2e_repeat=int(sys.argv[1]) if len(sys.argv) > 1 else 20)
try:
    r = B.bench_end_to_end(args, "page_first", holder, 32, 16)
    print({k: round(v * 1e3, 2) for k, v in r["median_s"].items()})
    for k, v in T.items():
        print(k, len(v), f"median {statistics.median(v)*1e3:.2f} ms")
finally:
    holder.close(); master.stop()
