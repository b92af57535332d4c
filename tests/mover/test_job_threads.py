"""JobThreads: the mover's worker threads (kvmove/mover/job_threads.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from kvmove.mover import job_threads
from kvmove.mover.job_threads import JobThreads, QueuedCall
from kvmove.mover.transfer import StealableJob

ROOT = Path(__file__).resolve().parent.parent


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_submit_gives_the_result_and_the_exception():
    threads = JobThreads(2, "t")
    try:
        ok = threads.submit(lambda a, b: a + b, 2, 3)
        bad = threads.submit(lambda: 1 / 0)
        assert isinstance(ok, Future) and ok.result(10) == 5
        with pytest.raises(ZeroDivisionError):
            bad.result(10)
    finally:
        threads.shutdown()


class _allow:  # a guard: StealableJob enters guard()
    def __enter__(self):
        return True

    def __exit__(self, *exc):
        return False


def test_a_job_object_runs_as_queued_and_reports_itself():
    threads = JobThreads(1, "t")
    try:
        job = StealableJob(lambda: "done", _allow)
        threads.start(job)
        assert job.result(10) == "done"
        assert len(threads._threads) == 1
    finally:
        threads.shutdown()


def test_jobs_on_one_worker_run_in_order_and_threads_never_exceed_the_cap():
    threads = JobThreads(1, "t")
    order: list[int] = []
    gate = threading.Event()
    try:
        first = threads.submit(gate.wait, 10)
        rest = [threads.submit(order.append, i) for i in range(20)]
        assert len(threads._threads) == 1  # the only worker is busy: the jobs wait
        gate.set()
        first.result(10)
        for f in rest:
            f.result(10)
        assert order == list(range(20))
    finally:
        threads.shutdown()


def test_a_second_worker_starts_while_the_first_is_busy_and_an_idle_one_is_reused():
    threads = JobThreads(3, "t")
    gate = threading.Event()
    try:
        busy = threads.submit(lambda: (gate.wait(10), threading.current_thread().name)[1])
        beside = threads.submit(lambda: threading.current_thread().name)
        assert beside.result(10) in ("t_0", "t_1")  # ran while the other worker waits
        assert not busy.done()
        gate.set()
        assert {busy.result(10), beside.result()} == {"t_0", "t_1"}
        assert _wait_for(lambda: threads._shared.idle == 2)
        for _ in range(10):  # idle workers take these: no third thread, though allowed
            threads.submit(time.sleep, 0).result(10)
        assert len(threads._threads) == 2
    finally:
        threads.shutdown()


def test_shutdown_runs_the_jobs_queued_before_it_then_refuses_new_ones():
    threads = JobThreads(1, "t")
    gate = threading.Event()
    done: list[int] = []
    threads.submit(gate.wait, 10)
    queued = [threads.submit(done.append, i) for i in range(5)]
    threading.Timer(0.2, gate.set).start()
    threads.shutdown(wait=True)
    assert done == list(range(5)) and all(f.done() for f in queued)
    assert all(not t.is_alive() for t in threads._threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.submit(print)
    threads.shutdown()  # idempotent


def test_a_cancelled_job_does_not_run():
    threads = JobThreads(1, "t")
    gate = threading.Event()
    ran: list[int] = []
    try:
        threads.submit(gate.wait, 10)
        job = threads.submit(ran.append, 1)
        assert job.cancel()
        gate.set()
        threads.submit(time.sleep, 0).result(10)
        assert ran == [] and job.cancelled()
    finally:
        threads.shutdown()


def test_a_job_whose_run_raises_leaves_the_worker_up(caplog):
    class Broken:
        def run(self):
            raise RuntimeError("broken job")

    threads = JobThreads(1, "t")
    try:
        threads.start(Broken())
        assert threads.submit(lambda: 7).result(10) == 7
        assert len(threads._threads) == 1
        assert "broken job" in caplog.text
    finally:
        threads.shutdown()


def test_a_queued_call_drops_its_arguments_once_run():
    job = QueuedCall(lambda x: x, (object(),))
    job.run()
    assert job._call is None and job.done()


def test_bad_max_workers_is_refused():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_workers"):
            JobThreads(bad, "t")


def test_threads_dropped_without_a_shutdown_end_once_collected():
    threads = JobThreads(2, "t-dropped")
    threads.submit(time.sleep, 0).result(10)
    workers = list(threads._threads)
    del threads
    gc.collect()
    assert _wait_for(lambda: not any(t.is_alive() for t in workers))


def test_jobs_queued_at_exit_run_before_the_process_ends_and_its_atexit_hooks(tmp_path):
    """A process that never shuts its threads down still runs what it queued (a put in
    flight is not dropped at exit), before the atexit hooks registered after the import
    (a store's close there would fail the put)."""
    out = tmp_path / "ran"
    code = f"""
import atexit, threading, time
from kvmove.mover.job_threads import JobThreads
threads = JobThreads(1, "t")
gate = threading.Event()
log = open({str(out)!r}, "w")
threads.submit(gate.wait, 10)
threads.submit(lambda: (time.sleep(0.3), log.write("job ")))
atexit.register(lambda: (log.write("hook"), log.close()))
threading.Timer(0.1, gate.set).start()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)
    assert out.read_text() == "job hook"


def test_start_all_starts_every_worker_idle_and_the_jobs_use_them():
    threads = JobThreads(3, "t")
    try:
        threads.start_all()
        started = list(threads._threads)
        assert len(started) == 3 and all(t.is_alive() for t in started)
        threads.start_all()  # again: nothing more
        # Three jobs that wait for each other run at once, on the three workers started,
        # none started by a job.
        gate = threading.Barrier(3, timeout=10)
        jobs = [threads.submit(lambda: (gate.wait(), threading.current_thread())[1])
                for _ in range(3)]
        ran_on = {job.result(10) for job in jobs}
        assert ran_on == set(started) and threads._threads == started
    finally:
        threads.shutdown()
    assert not any(t.is_alive() for t in started)
    with pytest.raises(RuntimeError, match="after shutdown"):
        threads.start_all()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_workers_are_sched_batch_unless_told_not_to(monkeypatch):
    """A worker woken by a queued job does not preempt the caller that queued it (who holds
    the GIL): its policy is ``SCHED_BATCH``; ``KVMOVE_WORKERS_SCHED_BATCH=0`` keeps the
    default. The caller's own policy never changes."""
    mine = os.sched_getscheduler(0)
    pool = JobThreads(1, "batch")
    assert pool.submit(os.sched_getscheduler, 0).result(10) == os.SCHED_BATCH
    pool.shutdown()
    monkeypatch.setenv(job_threads.BATCH_ENV, "0")
    pool = JobThreads(1, "default")
    assert pool.submit(os.sched_getscheduler, 0).result(10) == mine
    pool.shutdown()
    assert os.sched_getscheduler(0) == mine
