"""No call hangs: the bounded wait on native calls (kvmove.store.bounded_call), and the store
and the mover around a Mooncake call that really stalls (a holder process stopped with
SIGSTOP, nothing mocked): the call ends FAILED at the bound, its memory stays in use (the
store's registration, the mover's staging slots) until Mooncake really returns, nothing of
it reaches the KV rows, and the store, its replacement client and the mover stay usable."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.status import CALL_TIMEOUT
from kvmove.store.bounded_call import (
    IDLE_TICK_S,
    CallRunner,
    SpanBudget,
    Watchdog,
    call_bounded,
    call_watched,
    settled,
    start_call,
    wait_until_returned,
)
from tests.support.caches import make_layers, snapshot
from tests.support.holder import Holder
from tests.support.store_state import regions_in_use, registered_regions

ROOT = Path(__file__).resolve().parent.parent.parent

PAGE = 4


def test_a_call_past_its_bound_is_late_and_completes_when_it_returns():
    release = threading.Event()
    returned = []
    out = call_bounded(release.wait, 30, timeout=0.05, on_return=lambda: returned.append(1))
    assert not out.done and out.late is not None and not out.late.done()
    assert returned == []
    # Another call is not held up by the stuck one.
    quick = call_bounded(lambda x: x * 2, 21, timeout=5)
    assert quick.done and quick.value == 42
    joined = settled([out.late, None, quick.late])
    assert joined is out.late
    release.set()
    assert out.late.result(5) is True
    assert returned == [1]
    assert settled([out.late]) is None


def test_a_started_call_is_bounded_from_its_start_not_from_the_wait():
    release = threading.Event()
    started = start_call(release.wait, 30)
    time.sleep(0.2)  # the caller works meanwhile, longer than the bound
    t0 = time.monotonic()
    out = started.outcome(0.1)
    assert time.monotonic() - t0 < 0.05  # no wait left: late at once
    assert not out.done and out.late is started.future and out.seconds >= 0.2
    release.set()
    assert out.late.result(5) is True
    quick = start_call(lambda x: x + 1, 1)
    quick.future.result(5)
    time.sleep(0.1)
    out = quick.outcome(0.05)  # ended in time, taken after the bound passed
    assert out.done and out.value == 2


class Interrupted(BaseException):
    """What the tests' SIGINT handler raises (a KeyboardInterrupt sent at the wrong moment
    would end the whole pytest run)."""


@contextlib.contextmanager
def interrupts_raise():
    """SIGINT raises :class:`Interrupted` on the main thread within the block; yields a
    function that sends one to the main thread."""
    def handler(signum, frame):
        raise Interrupted

    main = threading.main_thread().ident
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("how", ["outcome", "wait_until_returned"])
def test_an_interrupted_wait_goes_on_only_once_the_call_returned(how):
    # The frames above free the call's memory as the interruption passes them: it must not
    # pass while the call still writes there, even when interrupted twice, and it is never
    # lost (a Ctrl-C still stops the program).
    release = threading.Event()
    ended = []

    def call():
        release.wait(30)
        ended.append(time.monotonic())
        return 1

    with interrupts_raise() as interrupt:
        started = start_call(call)
        timers = [threading.Timer(0.3, interrupt), threading.Timer(0.6, interrupt),
                  threading.Timer(1.0, release.set)]
        try:
            for t in timers:
                t.start()
            with pytest.raises(Interrupted):
                if how == "outcome":
                    started.outcome(30)
                else:
                    wait_until_returned(start_call(time.sleep, 0.01).future, started.future)
            raised = time.monotonic()
        finally:  # no signal comes once the test's handler is gone
            for t in timers:
                t.join()
            time.sleep(0.05)
    assert ended and ended[0] <= raised
    assert raised - started.started >= 0.95
    assert started.future.result(1) == 1


def test_errors_are_returned_and_settled_joins_several():
    out = call_bounded(lambda: 1 / 0, timeout=5)
    assert out.done and isinstance(out.error, ZeroDivisionError)
    gates = [threading.Event() for _ in range(3)]
    runner = CallRunner("test-runner", max_idle=1)
    lates = [call_bounded(g.wait, 30, timeout=0.01, runner=runner).late for g in gates]
    joined = settled(lates)
    for g in gates[:2]:
        g.set()
    time.sleep(0.05)
    assert not joined.done()
    gates[2].set()
    joined.result(5)


def test_start_idle_starts_threads_that_the_next_calls_run_on():
    runner = CallRunner("test-idle", max_idle=4)

    def named() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "test-idle"}

    runner.start_idle(3)
    started = named()
    assert len(started) == 3
    runner.start_idle(2)  # three idle already: none more
    runner.start_idle(9)  # at most max_idle
    started = named()
    assert len(started) == 4
    # Four calls that wait for each other run at once, on those threads, starting none.
    gate = threading.Barrier(4, timeout=10)
    futures = [runner.submit(lambda: (gate.wait(), threading.current_thread())[1])
               for _ in range(4)]
    assert {f.result(10) for f in futures} == started and named() == started


def test_a_started_watchdog_gives_up_on_a_late_call_from_its_own_thread():
    dog = Watchdog(name="test-dog")
    try:
        dog.start()
        dog.start()  # once
        started = [t for t in threading.enumerate() if t.name == "test-dog"]
        assert len(started) == 1
        fired = []
        out = call_watched(time.sleep, 1.5, timeout=0.05, watchdog=dog,
                           on_late=lambda late: fired.append(threading.current_thread()))
        assert not out.done and fired == started
    finally:
        dog.stop()


def test_a_forked_child_runs_its_calls_on_threads_of_its_own():
    # The parent's runner threads (started idle) and watchdog thread are not in a forked
    # child: the child counts none, and starts its own for its first calls.
    script = textwrap.dedent("""
        import os, time
        from kvmove.store import bounded_call as bc
        bc.start_call_threads(2)
        assert bc.default_runner().submit(lambda: 1).result(10) == 1
        pid = os.fork()
        if pid == 0:
            try:
                ran = bc.default_runner().submit(lambda: 42).result(10) == 42
                fired = []
                out = bc.call_watched(time.sleep, 1.5, timeout=0.05, on_late=fired.append)
                os._exit(0 if ran and fired and not out.done else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.stdout.split() == ["0"], (out.stdout, out.stderr[-2000:])


def test_a_watched_call_runs_here_and_gives_its_value_or_error():
    here = threading.get_ident()
    ran, late_calls = [], []
    out = call_watched(lambda x: ran.append(threading.get_ident()) or x * 2, 21, timeout=5,
                       on_late=late_calls.append)
    assert out.done and out.value == 42 and out.late is None
    assert ran == [here]  # no hand-off
    out = call_watched(lambda: 1 / 0, timeout=5, on_late=late_calls.append)
    assert out.done and isinstance(out.error, ZeroDivisionError)
    time.sleep(0.1)
    assert late_calls == []  # disarmed in time: the watchdog never fires for them
    with pytest.raises(KeyboardInterrupt):  # not an outcome: it propagates
        call_watched(lambda: (_ for _ in ()).throw(KeyboardInterrupt), timeout=5)


def test_a_watched_call_past_its_bound_is_given_up_then_and_returns_when_it_ends():
    here = threading.get_ident()
    fired = []  # (seconds after the start, thread, the late future's state then)

    handed: list = []  # the futures on_late was given

    def on_late(late):
        fired.append((time.monotonic() - t0, threading.get_ident(), late.done()))
        handed.append(late)

    t0 = time.monotonic()
    out = call_watched(time.sleep, 1.0, timeout=0.2, on_late=on_late)
    took = time.monotonic() - t0
    assert took >= 1.0  # it returned only once the call had
    assert len(fired) == 1
    at, thread, was_done = fired[0]
    assert 0.2 <= at < 0.8 and thread != here and not was_done  # given up at the bound
    assert not out.done and out.late is not None and out.late.done()
    assert out.late.result() is None  # what the call returned
    assert handed == [out.late] and handed[0] is out.late  # on_late saw the same future
    fired.clear()
    out = call_watched(lambda: time.sleep(0.5) or 1 / 0, timeout=0.1, on_late=on_late)
    assert len(fired) == 1 and not out.done
    with pytest.raises(ZeroDivisionError):
        out.late.result()
    assert handed[-1] is out.late


def test_the_watchdog_wakes_for_an_earlier_deadline_and_survives_a_raising_callback():
    dog = Watchdog(timeout=30.0, name="test-watchdog")
    fired = []
    try:
        dog.arm("long", lambda: fired.append("long"))  # the thread sleeps ~30 s for it
        dog.arm("boom", lambda: 1 / 0, timeout=0.05)
        t0 = time.monotonic()
        dog.arm("short", lambda: fired.append(("short", time.monotonic() - t0)), timeout=0.1)
        time.sleep(0.5)
        assert [f[0] for f in fired] == ["short"] and fired[0][1] < 0.4
        assert dog.disarm("long") is True  # still armed: returned in time
        assert dog.disarm("short") is False  # given up on
    finally:
        dog.stop()


class _CountingCondition(threading.Condition):
    waits = 0

    def wait(self, timeout=None):
        type(self).waits += 1
        return super().wait(timeout)


def test_calls_one_after_the_other_do_not_wake_the_watchdog_each_and_a_late_one_still_fires():
    dog = Watchdog(timeout=30.0, name="test-ticking-dog")
    dog._cond = _CountingCondition(dog._lock)
    try:
        for i in range(200):  # the hot path: each call returns before the next is armed
            dog.arm(i, lambda: None)
            time.sleep(0.001)  # the watchdog's thread gets the GIL meanwhile
            assert dog.disarm(i) is True
        assert _CountingCondition.waits <= 1 + 2 * (1 + int(0.5 / IDLE_TICK_S)), \
            _CountingCondition.waits  # one wake for the first call, then ticks at most
        fired = []
        t0 = time.monotonic()
        dog.arm("late", lambda: fired.append(time.monotonic() - t0), timeout=0.1)
        time.sleep(0.5)
        assert len(fired) == 1 and fired[0] < 0.4 and dog.disarm("late") is False
    finally:
        dog.stop()


def test_span_budget_counts_spans_in_flight():
    budget = SpanBudget(100)
    assert budget.acquire(60, 1) == 60
    assert budget.acquire(60, 0.05) == 0  # would pass the limit
    assert budget.acquire(500, 0.05) == 0  # a call larger than the limit waits for all
    budget.release(60)
    assert budget.acquire(500, 1) == 100 and budget.in_flight == 100
    budget.release(100)
    assert budget.in_flight == 0


def _waiting_acquire(budget: SpanBudget, spans: int, timeout: float) -> tuple[threading.Thread,
                                                                              list]:
    """An acquire on another thread, started and waiting: its thread and [(taken, when)]."""
    got: list[tuple[int, float]] = []
    waiter = threading.Thread(target=lambda: got.append((budget.acquire(spans, timeout),
                                                         time.monotonic())))
    waiter.start()
    deadline = time.monotonic() + 10
    while budget._waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget._waiting == 1 and not got
    return waiter, got


def test_a_span_budget_waiter_is_woken_by_the_release_that_makes_room():
    budget = SpanBudget(10)
    assert budget.acquire(10, 1) == 10
    waiter, got = _waiting_acquire(budget, 4, 30)
    released = time.monotonic()
    budget.release(4)  # room: woken now, not at its 30-s bound
    waiter.join(20)
    assert got and got[0][0] == 4 and got[0][1] - released < 10
    assert budget.in_flight == 10 and budget._waiting == 0


def test_a_span_budget_waiter_counts_a_release_without_room_as_progress():
    budget = SpanBudget(10)
    assert budget.acquire(10, 1) == 10
    waiter, got = _waiting_acquire(budget, 4, 2.0)
    budget.release(3)  # a call returned, but 3 spans are not room for 4: it waits on
    time.sleep(2.5)  # past its 2-s bound from its start: the release renewed it
    assert not got
    budget.release(3)  # room now
    waiter.join(20)
    assert got and got[0][0] == 4
    assert budget.in_flight == 8 and budget._waiting == 0


def _get_workers(mover):
    """The mover's pool of get jobs (its lifecycle's since the mover became a package)."""
    life = getattr(mover, "_life", None)
    return life.executor if life is not None else mover._executor


@pytest.mark.store
def test_a_stalled_holder_ends_failed_at_the_bound_and_memory_waits_for_mooncake():
    bound = 2.0
    with kvmove.EmbeddedMaster() as master:
        holder = Holder(master.address)
        store = kvmove.MooncakeStore(kvmove.StoreConfig(
            master_address=master.address, local_hostname="127.0.0.1",
            global_segment_size=0, call_timeout=bound))
        kv = kvmove.KVCache({"kv": make_layers(3, 64, 656, torch.uint8, seed=5)})
        mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8,
                               key_prefix="stall")
        try:
            src = torch.arange(0, 16).reshape(4, PAGE)
            dst = torch.arange(32, 48).reshape(4, PAGE)
            keys = [f"s{i}" for i in range(4)]
            assert mover.evict(keys, src).wait(30) == [Status.OK] * 4
            first = store._state.client
            holder.kill(signal.SIGSTOP)
            before = snapshot(kv)
            t0 = time.monotonic()
            result = mover.prefetch(keys, dst).result(30)
            took = time.monotonic() - t0
            assert result.statuses == [Status.FAILED] * 4
            assert result.codes == [CALL_TIMEOUT] * 4
            assert took < 30  # Mooncake alone would take its 60-s cap
            after = snapshot(kv)  # nothing reached the KV rows
            assert all(torch.equal(a, b) for a, b in zip(before["kv"], after["kv"],
                                                         strict=True))
            # The get given up still owns its memory: slots allocated, region in use,
            # and the mover's close leaves the staging to the call's return.
            assert mover.staging.num_free == 4
            staging_regions = {a for a, _ in mover.staging.regions()}
            assert staging_regions & set(regions_in_use(store))
            with pytest.raises(kvmove.StoreError, match="in flight"):
                store.unregister(mover.staging)
            deadline = time.monotonic() + 10
            while store._state.client is first and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store._state.client is not first  # replaced
            mover.close()  # returns at once; the staging is released later
            assert mover.staging.num_free == 4
        finally:
            holder.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while mover.staging.num_free < 8:
            assert time.monotonic() < deadline, "the get given up never returned"
            time.sleep(0.1)
        time.sleep(0.2)  # the last callback unregisters the staging
        assert not staging_regions & {a for a, _ in registered_regions(store)}
        assert not regions_in_use(store)
        # The store (its new client) carries on.
        other = kvmove.KVCache({"kv": make_layers(3, 64, 656, torch.uint8, seed=6)})
        with kvmove.KVMover(other, store, page_tokens=PAGE, staging_slots=8,
                            key_prefix="stall2") as again:
            assert again.evict(keys, src).wait(30) == [Status.OK] * 4
            assert again.prefetch(keys, dst).wait(30) == [Status.OK] * 4
            for layer in range(3):
                assert torch.equal(other.layer("kv", layer)[32:48],
                                   other.layer("kv", layer)[0:16])
        store.close()
        holder.close()


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_an_interrupted_get_keeps_its_memory_until_mooncake_returns(path):
    # A caller whose wait() runs a queued prefetch itself is interrupted (a signal) while
    # the get stalls: the interruption reaches it only once Mooncake has returned, so the
    # staging slots (staged) and the regions the get writes (both paths) are not let go of
    # while Mooncake may still write into them.
    with kvmove.EmbeddedMaster() as master:
        holder = Holder(master.address)
        store = kvmove.MooncakeStore(kvmove.StoreConfig(
            master_address=master.address, local_hostname="127.0.0.1",
            global_segment_size=0, call_timeout=20.0))
        kv = kvmove.KVCache({"kv": make_layers(3, 64, 656, torch.uint8, seed=7)})
        mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8, workers=1,
                               path=path, key_prefix=f"interrupt-{path}")
        gate = threading.Event()
        seen = {}
        try:
            src = torch.arange(0, 16).reshape(4, PAGE)
            dst = torch.arange(32, 48).reshape(4, PAGE)
            keys = [f"i{i}" for i in range(4)]
            assert mover.evict(keys, src).wait(30) == [Status.OK] * 4
            _get_workers(mover).submit(gate.wait, 30)  # the worker is busy: the waiter runs it
            holder.kill(signal.SIGSTOP)

            def resume():
                seen["free"] = mover.staging.num_free if path == "staged" else None
                seen["in_use"] = set(regions_in_use(store))
                seen["resumed"] = time.monotonic()
                holder.proc.send_signal(signal.SIGCONT)

            with interrupts_raise() as interrupt:
                t = mover.prefetch(keys, dst)
                timers = [threading.Timer(0.5, interrupt), threading.Timer(1.5, resume)]
                try:
                    for timer in timers:
                        timer.start()
                    with pytest.raises(Interrupted):
                        t.wait()
                    seen["raised"] = time.monotonic()
                finally:
                    for timer in timers:
                        timer.join()
                    time.sleep(0.05)
            written = ({a for a, _ in mover.staging.regions()} if path == "staged"
                       else {kv.layer("kv", 0).data_ptr()})
            assert seen["raised"] > seen["resumed"]  # the get returned first
            assert seen["in_use"] & written  # still in use while the get stalled
            if path == "staged":
                assert seen["free"] == 4  # its slots still allocated
        finally:
            gate.set()
            holder.proc.send_signal(signal.SIGCONT)
        # Once returned, everything is let go of and the mover carries on.
        assert mover.prefetch(keys, dst).wait(30) == [Status.OK] * 4
        for layer in range(3):
            assert torch.equal(kv.layer("kv", layer)[32:48], kv.layer("kv", layer)[0:16])
        if path == "staged":
            assert mover.staging.num_free == 8
        mover.close()
        store.close()
        holder.close()
