"""``JobThreads``: the worker threads that run a mover's background jobs.

A leaner :class:`concurrent.futures.ThreadPoolExecutor` for the hot path. A job that is a
future already (:class:`kvmove.mover.transfer.StealableJob`) is queued as it is, with no second
future around it, and a worker that has finished a job goes straight back to the queue. The
thread waiting for a job is woken by the job's ``set_result``, and then needs the GIL, which
the worker holds until it blocks on the queue again: whatever the worker does between the
two (an executor's second future and its idle semaphore) delays the waiter. Measured on a
2-vCPU VM with cold caches, as after a transfer: a submit 25-26 -> 16-18 µs, the waiter back
2-8 µs sooner (bench/results/cpu-amd-epyc-2c-20261205-lean-jobs/job_hand_off.txt).

Not the store's :class:`~kvmove.store.bounded_call.CallRunner`, which starts a thread for
every call that finds none idle (a stuck native call must never hold up another) and is
never shut down: a mover's jobs need a cap (prefetch jobs wait for staging slots that the
puts on a separate pool free) and a shutdown that waits for what was queued.

Threads start on demand, up to ``max_workers`` (or all at once, :meth:`JobThreads.start_all`,
before serving: a thread started by a job's call costs that call about 0.1 ms), and stay
until :meth:`JobThreads.shutdown`,
which runs every job queued before it, then ends them. They are daemon threads; a process
that exits without shutting them down runs the jobs queued until then first, where an
executor's threads would (before the interpreter's own ``atexit`` hooks, such as a store's
close), so that a put in flight is not dropped. ``JobThreads`` dropped without a shutdown
(garbage) end their threads once their queue is empty; such a pool is not waited for at
exit (a mover's queued jobs hold the mover, and so its pools, until they have run).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from concurrent.futures import Future

__all__ = ["JobThreads", "QueuedCall"]

log = logging.getLogger(__name__)

_STOP = object()  # tells a worker to end
_LIVE: weakref.WeakSet = weakref.WeakSet()  # JobThreads not shut down, drained at exit


class QueuedCall(Future):
    """``fn(*args)`` as a job: a :class:`~concurrent.futures.Future` that ``run()``
    completes with what it returned or raised."""

    def __init__(self, fn, args: tuple):
        super().__init__()
        self._call = (fn, args)

    def run(self) -> None:
        fn, args = self._call
        self._call = None  # the future does not keep the job's arguments alive
        if not self.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as e:  # surfaced by result(), as an executor's would be
            self.set_exception(e)
        else:
            self.set_result(result)


class _Shared:
    """What the workers share with their ``JobThreads`` (never the ``JobThreads`` itself,
    so that one dropped without a shutdown can be collected, and its workers told to end)."""

    __slots__ = ("idle", "lock", "queue")

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = 0  # workers waiting on the queue with no job queued for them


def _work(shared: _Shared, name: str) -> None:
    get, lock = shared.queue.get, shared.lock
    while True:
        job = get()
        if job is _STOP:
            return
        try:
            job.run()
        except BaseException:  # a job reports its own errors; the worker stays up
            log.exception("%s: a job raised", name)
        del job
        with lock:
            shared.idle += 1


def _stop_workers(shared: _Shared, threads: list[threading.Thread]) -> None:
    """Queue one stop per worker, after every job queued so far."""
    with shared.lock:
        for _ in threads:
            shared.queue.put(_STOP)


class JobThreads:
    """Up to ``max_workers`` threads named ``name_<i>`` that run queued jobs in order.

    - ``submit(fn, *args)``: queue a call; its future.
    - ``start(job)``: queue an object whose ``run()`` does the work and reports it (a
      future of its own, such as :class:`kvmove.mover.transfer.StealableJob`).
    - ``start_all()``: start every worker now, before the first job.
    - ``shutdown(wait=True)``: no job is taken after it; those queued before it run, and
      with ``wait`` it returns once they have (from a worker's own thread it does not
      wait for that thread).
    """

    def __init__(self, max_workers: int, name: str):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) \
                or max_workers < 1:
            raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self.name = name
        self._shared = _Shared()
        self._threads: list[threading.Thread] = []
        self._shut = False
        # Collected without a shutdown: the workers end once the jobs queued are done. Not
        # at exit: _drain_at_exit shuts every live pool down there, jobs first.
        self._stop = weakref.finalize(self, _stop_workers, self._shared, self._threads)
        self._stop.atexit = False
        _LIVE.add(self)

    def submit(self, fn, *args) -> Future:
        job = QueuedCall(fn, args)
        self.start(job)
        return job

    def start(self, job) -> None:
        """Queue ``job`` (``job.run()`` runs on a worker). ``RuntimeError`` after
        :meth:`shutdown`."""
        shared = self._shared
        with shared.lock:
            if self._shut:
                raise RuntimeError(f"{self.name}: cannot queue a job after shutdown")
            if shared.idle:
                shared.idle -= 1  # an idle worker takes it
            elif len(self._threads) < self.max_workers:
                self._start_thread()
            shared.queue.put(job)

    def start_all(self) -> None:
        """Start every worker not started yet, idle until jobs come (a pool about to serve:
        no job's call then starts a thread). ``RuntimeError`` after :meth:`shutdown`."""
        shared = self._shared
        with shared.lock:
            if self._shut:
                raise RuntimeError(f"{self.name}: cannot start workers after shutdown")
            while len(self._threads) < self.max_workers:
                self._start_thread()
                shared.idle += 1

    def _start_thread(self) -> None:
        """Start one more worker (``shared.lock`` held: a shutdown joins only started
        threads)."""
        thread = threading.Thread(target=_work, args=(self._shared, self.name), daemon=True,
                                  name=f"{self.name}_{len(self._threads)}")
        thread.start()
        self._threads.append(thread)

    def shutdown(self, wait: bool = True) -> None:
        with self._shared.lock:
            self._shut = True
            threads = list(self._threads)
        self._stop()  # once: a finalizer runs at most once
        _LIVE.discard(self)
        if wait:
            current = threading.current_thread()
            for thread in threads:
                if thread is not current:
                    thread.join()


def _drain_at_exit() -> None:
    """Run the jobs still queued on threads nobody shut down (daemon threads would be
    stopped mid-job once the interpreter finalizes)."""
    for threads in list(_LIVE):
        threads.shutdown(wait=True)


# Where concurrent.futures drains its executors: when the main thread ends, before the
# atexit hooks (registered after this module's import, a hook such as store.close would
# otherwise run first: they run last-registered first).
_register = getattr(threading, "_register_atexit", atexit.register)
_register(_drain_at_exit)
