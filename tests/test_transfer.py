"""``StealableJob``: a job queued for a worker that the first waiter runs itself when no worker
has started it; it runs exactly once whoever gets there first, a waiter's run happens inside
the guard, and errors surface from ``result()``. ``FutureEvent``: an event for host work."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvmove.transfer import FutureEvent, StealableJob


def counting_guard(log: list):
    @contextlib.contextmanager
    def guard():
        log.append("enter")
        yield
        log.append("exit")

    return guard


def test_a_waiter_runs_the_job_no_worker_has_started_and_the_worker_then_skips_it():
    runs, guarded = [], []
    job = StealableJob(lambda: runs.append(threading.current_thread().name) or 42,
                       counting_guard(guarded))
    assert job.result(1) == 42 and job.done()
    job.run()  # the worker comes late: nothing to do
    assert runs == [threading.current_thread().name] and guarded == ["enter", "exit"]


def test_a_job_a_worker_started_is_waited_for_not_run_again():
    started, release, runs, guarded = threading.Event(), threading.Event(), [], []

    def work():
        started.set()
        assert release.wait(10)
        runs.append(threading.current_thread().name)
        return "done"

    job = StealableJob(work, counting_guard(guarded))
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        pool.submit(job.run)
        assert started.wait(10)
        with pytest.raises(TimeoutError):
            job.result(0.05)
        release.set()
        assert job.result(10) == "done"
    assert len(runs) == 1 and runs[0].startswith("worker") and guarded == []


def test_racing_runs_and_waits_run_the_job_once():
    for _ in range(50):
        runs = []
        job = StealableJob(lambda runs=runs: runs.append(1), counting_guard([]))
        threads = [threading.Thread(target=job.run), threading.Thread(target=job.steal),
                   threading.Thread(target=job.result)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert runs == [1]


def test_an_error_of_a_stolen_job_surfaces_from_result():
    def fail():
        raise ValueError("boom")

    job = StealableJob(fail, counting_guard([]))
    with pytest.raises(ValueError, match="boom"):
        job.result(1)
    assert isinstance(job.exception(), ValueError)


def test_a_future_event_waits_for_its_job():
    future: Future = Future()
    event = FutureEvent(future)
    assert not event.query()
    threading.Timer(0.05, future.set_result, args=(None,)).start()
    event.wait()  # a stream argument changes nothing: the host waits
    assert event.query()
    event.synchronize()
