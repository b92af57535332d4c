"""Throwaway: host µs of a few small torch operations on this machine (CPU tensors), to set beside the H200 host's figures in bench/results/gpu-nvidia-h200-20261204-evening/micro.log (CUDA tensors there)."""
import time, torch
blk = torch.zeros(4096, dtype=torch.int32)
b = torch.arange(16)
def t(name, f, n=20000):
    for _ in range(2000): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    print(f"{name:40s} {(time.perf_counter()-t0)/n*1e6:7.2f} us")
i = iter(range(10**9))
t("torch.zeros(1, int32)", lambda: torch.zeros(1, dtype=torch.int32))
t("slice of a zeroed block", lambda: blk[next(i) % 4096:][:1])
t("narrow of a zeroed block", lambda: blk.narrow(0, next(i) % 4096, 1))
t("tensor.contiguous() (already)", lambda: b.contiguous())
