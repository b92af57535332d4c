# throwaway: the bounded call's thread hand-off on this VM
import time, statistics, threading
from kvmove.store.bounded_call import call_bounded
def f(): return 1
def sleeper(): time.sleep(0.002); return 1
for name, fn in (("noop", f), ("2ms sleep", sleeper)):
    for _ in range(50): call_bounded(fn, timeout=10)
    a, b = [], []
    for _ in range(300):
        t0 = time.perf_counter(); call_bounded(fn, timeout=10); a.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); fn(); b.append(time.perf_counter() - t0)
    print(f"{name}: bounded {statistics.median(a)*1e6:.1f} us, direct {statistics.median(b)*1e6:.1f} us, added {(statistics.median(a)-statistics.median(b))*1e6:.1f} us")
