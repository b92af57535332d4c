# throwaway: single torch/numpy/Python calls, each timed right after a 32 MiB copy (cold caches), median of 55; .venv, no arguments
import time, statistics, numpy as np, torch
big_a = torch.empty(32 << 20, dtype=torch.uint8); big_b = torch.empty(32 << 20, dtype=torch.uint8)
def pollute(): big_b.copy_(big_a)
tp = torch.randperm(16)[:, None]; sl = torch.arange(16); lst = list(range(16)); arr = np.arange(16)
views = list(torch.zeros(4096, dtype=torch.int32).unbind(0))
x = torch.zeros(1000, 656, dtype=torch.uint8); out = torch.empty(16, 656, dtype=torch.uint8); ix = torch.arange(16)
ops = {
 "nothing": lambda: None,
 "torch.zeros": lambda: torch.zeros(1, dtype=torch.int32),
 "views.pop": lambda: views.pop(),
 "np.array(list)": lambda: np.array(lst, dtype=np.int64),
 "from_numpy": lambda: torch.from_numpy(arr),
 "torch.tensor(list)": lambda: torch.tensor(lst),
 "np increasing": lambda: bool((arr[1:] > arr[:-1]).all()),
 "set unique": lambda: len(set(lst)) == len(lst),
 "tolist 2d": lambda: tp.tolist(),
 "tolist 1d": lambda: sl.tolist(),
 "tensor.numpy()": lambda: sl.numpy(),
 "index_select": lambda: torch.index_select(x, 0, ix, out=out),
 "narrow": lambda: x.narrow(0, 3, 1),
}
res = {k: [] for k in ops}
for r in range(60):
    for k, f in ops.items():
        pollute()
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
for k, v in res.items(): print("%-20s %.1f" % (k, statistics.median(v[5:]) * 1e6))
