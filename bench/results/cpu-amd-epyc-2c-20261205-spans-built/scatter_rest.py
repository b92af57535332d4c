# throwaway: .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-spans-built/scatter_rest.py
# the staged scatter's numpy copy alone (61 layers x 768 scattered 656-byte rows), after gc.collect() and then nothing,
# a sleep, or a busy spin of the same length
import gc, time, statistics, numpy as np
L, n, row, slots = 61, 768, 656, 4 * 768 + 2
kv = np.random.randint(0, 255, (L, slots, row), dtype=np.uint8)
st = np.random.randint(0, 255, (L, n, row), dtype=np.uint8)
to = 2 * np.random.permutation(slots // 2)[:n]
def scatter():
    for i in range(L):
        kv[i][to] = st[i]
def spin(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s: pass
modes = {"gc": lambda: None, "sleep 1ms": lambda: time.sleep(0.001), "sleep 20ms": lambda: time.sleep(0.02),
         "spin 20ms": lambda: spin(0.02)}
out = {k: [] for k in modes}
for r in range(30):
    for k, f in modes.items():
        gc.collect(); f()
        t0 = time.perf_counter(); scatter(); out[k].append(time.perf_counter() - t0)
print(" | ".join(f"{k} {statistics.median(v)*1e3:.2f} ms" for k, v in out.items()))
