# throwaway: how cheap can a thread hand-off be here (lock pair vs Future + SimpleQueue)
import threading, time, statistics
start, done = threading.Lock(), threading.Lock()
start.acquire(); done.acquire()
box = [None]
def worker():
    while True:
        start.acquire()
        fn = box[0]
        box[0] = fn()
        done.release()
threading.Thread(target=worker, daemon=True).start()
def call(fn):
    box[0] = fn
    start.release()
    done.acquire(timeout=10)
    return box[0]
f = lambda: 1
for _ in range(100): call(f)
a = []
for _ in range(1000):
    t0 = time.perf_counter(); call(f); a.append(time.perf_counter() - t0)
print(f"lock pair: {statistics.median(a)*1e6:.1f} us")
import queue
from concurrent.futures import Future
q = queue.SimpleQueue()
def worker2():
    while True:
        fut, fn = q.get()
        fut.set_result(fn())
threading.Thread(target=worker2, daemon=True).start()
def call2(fn):
    fut = Future(); q.put((fut, fn)); return fut.result(10)
for _ in range(100): call2(f)
a = []
for _ in range(1000):
    t0 = time.perf_counter(); call2(f); a.append(time.perf_counter() - t0)
print(f"future + queue: {statistics.median(a)*1e6:.1f} us")
