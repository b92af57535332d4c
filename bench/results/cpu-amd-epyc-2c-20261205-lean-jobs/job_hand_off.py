# throwaway: .venv/bin/python bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/job_hand_off.py 200
# one job queued and waited for, with cold caches (a 128 MiB copy before each): ThreadPoolExecutor.submit(job.run) against a
# SimpleQueue worker pool of the JobThreads kind; submit = the call, wake = submit -> the job starts, back = the job's end -> the waiter returns
import time, threading, queue, statistics, sys
from concurrent.futures import ThreadPoolExecutor, Future
import torch
a = torch.empty(128 << 20, dtype=torch.uint8); b = torch.empty_like(a); a.fill_(1)

class Job(Future):
    def __init__(self, fn):
        super().__init__(); self.fn = fn
    def run(self):
        if self.set_running_or_notify_cancel():
            self.set_result(self.fn())

class Lean:
    def __init__(self, n):
        self.q = queue.SimpleQueue(); self.lock = threading.Lock(); self.idle = 0; self.threads = []; self.n = n
    def start(self, job):
        with self.lock:
            if self.idle: self.idle -= 1
            elif len(self.threads) < self.n:
                t = threading.Thread(target=self.work, daemon=True); self.threads.append(t); t.start()
        self.q.put(job)
    def work(self):
        while True:
            job = self.q.get()
            job.run()
            del job
            with self.lock: self.idle += 1

M = {}
def body():
    M["start"] = time.perf_counter(); b.copy_(a); M["end"] = time.perf_counter(); return 1
tpe = ThreadPoolExecutor(2); lean = Lean(2)
rows = {k: [] for k in ("tpe submit", "tpe wake", "tpe back", "lean submit", "lean wake", "lean back")}
for r in range(int(sys.argv[1])):
    for who in ("tpe", "lean"):
        b.copy_(a)
        job = Job(body)
        t0 = time.perf_counter()
        if who == "tpe": tpe.submit(job.run)
        else: lean.start(job)
        t1 = time.perf_counter()
        job.result(timeout=600)
        t2 = time.perf_counter()
        if r >= 5:
            rows[who + " submit"].append(t1 - t0); rows[who + " wake"].append(M["start"] - t1); rows[who + " back"].append(t2 - M["end"])
for k, v in rows.items(): print(f"{k:12s} {statistics.median(v)*1e6:6.1f} us")
