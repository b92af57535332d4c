# throwaway: a Future hand-off and a lock hand-off to one worker thread, round trip in µs, the worker pinned to vCPU argv[1], the caller to argv[2]
import threading, time, queue, statistics, os, sys
from concurrent.futures import Future
def noop(x): return x
wcpu, ccpu = int(sys.argv[1]), int(sys.argv[2])
q1 = queue.SimpleQueue()
def w1():
    os.sched_setaffinity(0, {wcpu})
    while True:
        f, fn, args = q1.get()
        if f.set_running_or_notify_cancel():
            f.set_result(fn(*args))
threading.Thread(target=w1, daemon=True).start()
def fut_plain():
    f = Future(); q1.put((f, noop, (1,))); return f.result(5.0)
q3 = queue.SimpleQueue()
class Slot:
    __slots__ = ("done", "value")
def w3():
    os.sched_setaffinity(0, {wcpu})
    while True:
        s, fn, args = q3.get()
        s.value = fn(*args)
        s.done.release()
threading.Thread(target=w3, daemon=True).start()
def light():
    s = Slot(); s.done = threading.Lock(); s.done.acquire(); q3.put((s, noop, (1,)))
    s.done.acquire(timeout=5.0); return s.value
os.sched_setaffinity(0, {ccpu})
fs = (fut_plain, light)
for f in fs:
    for _ in range(200): f()
res = {f.__name__: [] for f in fs}
for rep in range(11):
    for f in fs:
        t = time.perf_counter()
        for _ in range(500): f()
        res[f.__name__].append((time.perf_counter() - t) / 500 * 1e6)
for k, v in res.items(): print(wcpu, ccpu, k, "median us %.1f" % statistics.median(v), "min %.1f" % min(v))
