# throwaway: split kvmove's vLLM save/load time into the native Mooncake calls and the rest
import sys, time, statistics, threading, argparse
import kvmove.store.mooncake_store as ms
from kvmove.store import bounded_call
rec = {"native": [], "thread": []}
real = ms.call_bounded
def timed_call_bounded(fn, *args, **kw):
    name = getattr(fn, "__name__", "?")
    def wrapped(*a):
        t0 = time.perf_counter(); r = fn(*a); rec["native"].append((name, t0, time.perf_counter())); return r
    return real(wrapped, *args, **kw)
ms.call_bounded = timed_call_bounded
marks = []
def mark(cls, name):
    orig = getattr(cls, name)
    def w(*a, **k):
        marks.append((name, time.perf_counter())); r = orig(*a, **k); marks.append((name + " end", time.perf_counter())); return r
    setattr(cls, name, w)
mark(ms.MooncakeStore, "put"); mark(ms.MooncakeStore, "get"); mark(ms.MooncakeStore, "_bounded")
import kvmove.mover as mv
mark(mv.KVMover, "_describe"); mark(mv.KVMover, "_take_call")
import kvmove.in_place as ip
import bench.bench_vllm as bv
orig_timed = bv._timed
spans = []
def _timed(fn):
    rec["native"].clear(); marks.clear(); t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
    nat = [(n, a, b) for n, a, b in rec["native"]]
    spans.append((t1 - t0, nat, t0, [(m, (t - t0) * 1e3) for m, t in marks] + [(n + " native", (a - t0) * 1e3, (b - t0) * 1e3) for n, a, b in nat] + [("end", (t1 - t0) * 1e3)]))
    return t1 - t0
bv._timed = _timed
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[1]) if len(sys.argv) > 1 else 9, warmup=1, path="auto", quick=False, json=None)
res = bv.bench(args)
print({k: v for k, v in res.items() if "ratio" in k})
# kvmove rows: those with native calls recorded
ev = [(tot, nat, t0) for tot, nat, t0, _ in spans if nat]
for sp in [x for x in spans if x[1]][-6:]:
    print([(m[0], *[round(v, 3) for v in m[1:]]) for m in sorted(sp[3], key=lambda m: m[1])])
save = [(tot, nat, t0) for tot, nat, t0 in ev if any(n == "batch_put_from_multi_buffers" for n, _, _ in nat)]
load = [(tot, nat, t0) for tot, nat, t0 in ev if all(n == "batch_get_into_multi_buffers" for n, _, _ in nat)]
for name, rows in (("save", save), ("load", load)):
    tot = [r[0] * 1e3 for r in rows]
    nat = [sum(b - a for _, a, b in r[1]) * 1e3 for r in rows]
    before = [(r[1][0][1] - r[2]) * 1e3 for r in rows]
    after = [(r[2] + r[0] - r[1][-1][2]) * 1e3 for r in rows]
    print(f"kvmove {name}: n={len(rows)} total {statistics.median(tot):.2f} ms, native calls {statistics.median(nat):.2f} ms, "
          f"before first native {statistics.median(before):.3f} ms, after last {statistics.median(after):.3f} ms, calls/row {[n for n,_,_ in rows[0][1]]}")
