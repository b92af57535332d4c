"""Throwaway: what populating staging memory costs when it is made (HostMemory of 64 MiB
and 1 GiB, unpinned), and writing all of it once made (what the first transfers through
fresh slots paid before, spread over them)."""
import time

from kvmove.memory.host_memory import HostMemory

for size in (64 << 20, 1 << 30):
    t0 = time.perf_counter()
    m = HostMemory(size, pin=False)
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.tensor.fill_(1)
    written = time.perf_counter() - t0
    m.close()
    print(f"{size >> 20} MiB: made in {made * 1e3:.1f} ms, then written in {written * 1e3:.1f} ms")
