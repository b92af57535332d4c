# throwaway: PYTHONPATH=. .venv-vllm/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/timeline_with_native.py
# ../cpu-amd-epyc-2c-20261205-watched-calls/timeline_in_bench.py with each row's native time printed too
# bench_vllm as it runs (--repeat 15), patched in a copy: the Mooncake client's data calls
# timed, so each row's time outside the native call is known, and kvmove's asynchronous load
# cut into segments (prefetch call, _take_call, the job, describe, store.get, the native call)
import pathlib, sys
src = pathlib.Path("bench/bench_vllm.py").read_text()
patches = [
    ('''        client = store._client  # vLLM's path talks to the same Mooncake client''', '''        real_client = store._client
        NAT = {}
        class Wrapped:
            def __init__(self, fn, name):
                self.fn = fn; self.__name__ = name
            def __call__(self, *args):
                t0 = time.perf_counter(); MARKS["s"] = t0; r = self.fn(*args); MARKS["e"] = time.perf_counter(); NAT["t"] = NAT.get("t", 0) + time.perf_counter() - t0; return r
        class C:
            def __getattr__(self, name): return getattr(real_client, name)
        client = C()
        for nm in ("batch_get_into_multi_buffers", "batch_put_from_multi_buffers"):
            w = Wrapped(getattr(real_client, nm), nm); w.__self__ = client; setattr(client, nm, w)
        store._client = store._state.client = client
        store._budgets[id(client)] = store._budgets[id(real_client)]
        store._state.users[id(client)] = 0
        global _NAT
        _NAT = NAT'''),
    ('''def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0''', '''OVER = {}
NATS = {}
MARKS = {}
SEGS = {}
import kvmove.mover as _M, kvmove.store.mooncake_store as _MS, kvmove.in_place as _IP
def _wrap(cls, name, before, after):
    orig = getattr(cls, name)
    def f(*args, **kw):
        MARKS[before] = time.perf_counter(); r = orig(*args, **kw); MARKS[after] = time.perf_counter(); return r
    setattr(cls, name, f)
_wrap(_M.KVMover, "prefetch", "p0", "ret")
_wrap(_M.KVMover, "_take_call", "tc0", "tc1")
_wrap(_M.KVMover, "_get_in_place", "job0", "job1")
_wrap(_IP.InPlaceRows, "describe_trusted", "d0", "d1")
_wrap(_MS.MooncakeStore, "get", "g0", "g1")
_SEQ = ["t0", "p0", "tc0", "tc1", "job0", "d0", "d1", "g0", "s", "e", "g1", "job1", "t2"]
def _timed(fn) -> float:
    _NAT["t"] = 0
    t0 = time.perf_counter()
    MARKS["t0"] = t0
    fn()
    dt = time.perf_counter() - t0
    MARKS["t2"] = t0 + dt
    OVER.setdefault(_CUR[0], []).append(dt - _NAT["t"]); NATS.setdefault(_CUR[0], []).append(_NAT["t"])
    if _CUR[0] == "kvmove load":
        for x, y in zip(_SEQ, _SEQ[1:]):
            SEGS.setdefault(f"{x}->{y}", []).append(MARKS[y] - MARKS[x])
    return dt
_CUR = [None]'''),
    ('''                times[_row(who, "save")] = _timed(''', '''                _CUR[0] = _row(who, "save")
                times[_row(who, "save")] = _timed('''),
    ('''                times[_row(who, "load")] = _timed(''', '''                _CUR[0] = _row(who, "load")
                times[_row(who, "load")] = _timed('''),
    ('''            times["kvmove load (layer-wise)"] = _timed(''', '''            _CUR[0] = "kvmove load (layer-wise)"
            times["kvmove load (layer-wise)"] = _timed('''),
    ('''        mover.close()
    med = ''', '''        mover.close()
        store._client = store._state.client = real_client
    print("kvmove load, segments (medians):")
    for k_, v_ in SEGS.items():
        print(f"  {k_:12s} {statistics.median(v_)*1e6:7.0f} us")
    for k_, v_ in OVER.items():
        print(f"{k_:30s} outside the native call: median {statistics.median(v_)*1e6:7.0f} us native {statistics.median(NATS[k_])*1e6:7.0f} us")
    med = '''),
]
for old, new in patches:
    assert old in src, old[:60]
    src = src.replace(old, new)
sys.argv = ["bench_vllm", "--repeat", "15"]
ns = {"__name__": "__main__", "__file__": "bench/bench_vllm.py"}
exec(compile(src, "bench/bench_vllm.py (patched)", "exec"), ns)
