"""kvmove.mover.transfer on its own: a Transfer's pieces joined in key order whatever order they
finish in, a bounded wait, layer progress in order, the CPU stand-ins for CUDA events;
``StealableJob`` (a job queued for a worker that the first waiter runs itself when no worker
has started it: exactly once, inside the guard, errors from ``result()``) and
``FutureEvent`` (an event for host work)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import pytest

from kvmove.mover.transfer import (
    CompletedEvent,
    FutureEvent,
    LayerProgress,
    StageTimes,
    StealableJob,
    Transfer,
    TransferResult,
    join_results,
)
from kvmove.status import Status

OK, MISS, FAILED = Status.OK, Status.MISS, Status.FAILED


def result(statuses, nbytes=0, put=0.0):
    return TransferResult(list(statuses), [0 if s is OK else -704 for s in statuses], nbytes,
                          StageTimes(put=put))


def test_pieces_are_joined_in_key_order():
    t = Transfer(["a", "b", "c", "d"], kind="evict", num_layers=2)
    late = Future()
    t.add_piece(2, late)
    t.add_piece(0, result([OK, MISS], nbytes=10, put=1.0))
    assert not t.done()
    late.set_result(result([FAILED, OK], nbytes=5, put=2.0))
    assert t.done()
    joined = t.result()
    assert joined.statuses == [OK, MISS, FAILED, OK] and t.wait() == joined.statuses
    assert joined.codes == [0, -704, -704, 0]
    assert joined.nbytes == 15 and joined.times.put == 3.0


def test_join_of_one_piece_is_that_piece():
    one = result([OK])
    assert join_results([one]) is one


def test_wait_is_bounded():
    t = Transfer(["a"], kind="prefetch", num_layers=1)
    t.add_piece(0, Future())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="prefetch of 1 keys still running"):
        t.wait(timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_wait_layer_checks_its_argument():
    t = Transfer(["a"], kind="prefetch", num_layers=3)
    for bad in (-1, 3, True, "1"):
        with pytest.raises(IndexError, match=r"layer must be in 0\.\.2"):
            t.wait_layer(bad)
    with pytest.raises(TimeoutError, match="layer 1"):
        t.wait_layer(1, timeout=0.1)


def test_layers_complete_in_order_and_finish_releases_every_waiter():
    progress = LayerProgress(3)
    reached = []

    def waiter(layer):
        reached.append((layer, progress.wait(layer, 10)[0]))

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in (0, 2)]
    for th in threads:
        th.start()
    progress.layers_done(1)
    time.sleep(0.05)
    assert progress.reached(0) and not progress.reached(1) and not progress.reached(None)
    progress.finish()  # e.g. the transfer ended early: nobody waits forever
    for th in threads:
        th.join(10)
    assert sorted(reached) == [(0, True), (2, True)]


def test_all_done_covers_every_layer():
    progress = LayerProgress(4)
    progress.all_done()
    assert all(progress.reached(layer) for layer in range(4)) and progress.reached(None)


def test_cpu_events_are_complete():
    t = Transfer(["a"], kind="evict", num_layers=1)
    assert isinstance(t.gathered, CompletedEvent)
    assert t.gathered.query() and t.gathered.synchronize() is None
    t.progress.all_done()
    assert t.scattered.query()
    t.scattered.synchronize()
    t.scattered.wait()


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
    assert job.result() == 42 and job.done()
    job.run()  # the worker comes late: nothing to do
    assert runs == [threading.current_thread().name] and guarded == ["enter", "exit"]


def test_a_job_drops_its_function_once_run():
    # The job's arguments (a prefetch's call, its index copies) are not kept alive by the
    # transfer that holds the job.
    class Arg:
        pass

    arg = Arg()
    ref = weakref.ref(arg)
    job = StealableJob(partial(lambda a: 5, arg), counting_guard([]))
    del arg
    assert ref() is not None
    assert job.result() == 5 and ref() is None


def test_a_bounded_wait_never_runs_the_job_it_waits_for():
    runs, guarded = [], []
    job = StealableJob(lambda: runs.append(threading.current_thread().name) or 7,
                       counting_guard(guarded))
    with pytest.raises(TimeoutError):  # the job may take longer than the wait: not run here
        job.result(0.05)
    assert runs == [] and guarded == [] and not job.done()
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        pool.submit(job.run)
        assert job.result(10) == 7
    assert len(runs) == 1 and runs[0].startswith("worker")


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
        job.result()
    assert isinstance(job.exception(), ValueError)


def test_a_future_event_waits_for_its_job():
    future: Future = Future()
    event = FutureEvent(future)
    assert not event.query()
    threading.Timer(0.05, future.set_result, args=(None,)).start()
    event.wait()  # a stream argument changes nothing: the host waits
    assert event.query()
    event.synchronize()
