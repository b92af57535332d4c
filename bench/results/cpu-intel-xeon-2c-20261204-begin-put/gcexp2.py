# throwaway: gc time inside each timed section of bench_vllm, per row
import gc, sys, time, argparse, statistics, collections
import bench.bench_vllm as bv
mode = sys.argv[1]
cur = {"t": 0.0, "n": 0, "g2": 0}
start = [0.0]
def cb(phase, info):
    if phase == "start":
        start[0] = time.perf_counter()
    else:
        cur["n"] += 1; cur["t"] += time.perf_counter() - start[0]; cur["g2"] += info["generation"] == 2
gc.callbacks.append(cb)
if mode == "freeze":
    gc.collect(); gc.freeze()
seq = []
def _timed(fn):
    cur.update(t=0.0, n=0, g2=0)
    t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
    seq.append((dt, cur["n"], cur["t"], cur["g2"]))
    return dt
bv._timed = _timed
args = argparse.Namespace(blocks=256, layers=16, heads=8, block_size=16, head_dim=64, repeat=int(sys.argv[2]), warmup=1, path="auto", quick=False, json=None)
orig_bench = bv.bench
res = bv.bench(args)
# order per repeat: 3 saves (rotated), 3 loads (rotated), layer-wise
print(mode, {k: v for k, v in res.items() if k in ("save_ratio", "load_ratio")})
per = 7
names_by_r = []
for r in range(args.warmup + args.repeat):
    order = ["kvmove", "vLLM", "vLLM (inline)"]
    order = order[r % 3:] + order[:r % 3]
    names_by_r += [w + " save" for w in order] + [w + " load" for w in order] + ["kvmove lw"]
agg = collections.defaultdict(list)
for name, (dt, n, t, g2) in zip(names_by_r, seq):
    agg[name].append((dt * 1e3, n, t * 1e3, g2))
for name, v in agg.items():
    print(f"{name:22s} ms {statistics.median(x[0] for x in v):6.2f}  gc runs/op {statistics.mean(x[1] for x in v):5.2f}  gc ms/op mean {statistics.mean(x[2] for x in v):5.2f} median {statistics.median(x[2] for x in v):5.2f} gen2 {sum(x[3] for x in v)}")
