"""``JobThreads``: the worker threads that run a mover's background jobs: a leaner
:class:`concurrent.futures.ThreadPoolExecutor` for the hot path. A job that is a future
already (:class:`kvmove.mover.transfer.StealableJob`) is queued as it is, and a worker goes
straight back to the queue after a job: the waiter it woke needs the GIL meanwhile (on a
2-vCPU VM a submit measured 25-26 -> 16-18 µs, the waiter back 2-8 µs sooner). Unlike the
store's ``CallRunner`` it has a cap and a shutdown that runs what was queued; threads are
daemons, and a process that exits without a shutdown runs the jobs queued until then first
(a put in flight is not dropped)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import Future

__all__ = ["JobThreads", "QueuedCall"]

log = logging.getLogger(__name__)

BATCH_ENV = "KVMOVE_WORKERS_SCHED_BATCH"  # "0": workers keep the default policy
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


def _mildly_disfavoured() -> None:
    """Make this worker ``SCHED_BATCH`` (Linux): woken by a caller's queued job, it does not
    preempt the caller on its core (who holds the GIL it would wait for at once); it runs
    on an idle core, or when the caller gives its core up. Elsewhere nothing changes."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or refused
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _work(shared: _Shared, name: str) -> None:
    if os.environ.get(BATCH_ENV, "1") != "0":
        _mildly_disfavoured()
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
    """Up to ``max_workers`` threads named ``name_<i>`` that run queued jobs in order:
    ``submit(fn, *args)`` (a future), ``start(job)`` (an object whose ``run()`` reports its
    own result), ``start_all()`` (every worker now, before the first job: one started by a
    call costs it ~0.1 ms), ``shutdown(wait=True)`` (no job taken after it; those queued
    before it run; it does not wait for the calling worker's own thread). Pools dropped
    without a shutdown end their threads once their queue is empty."""

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
