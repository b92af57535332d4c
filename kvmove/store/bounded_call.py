"""Bounded waits on native calls that take no timeout (Mooncake's store and Transfer Engine
calls; Mooncake's own cap is 60 s per transfer). :func:`call_bounded` and :func:`start_call`
run a call on a runner thread and wait at most ``timeout`` once it started; a call that timed
out is still in flight, and its future (``late``) completes only once it has really returned:
its memory must not be freed or reused before then. :class:`SpanBudget` counts a client's
spans in flight until their calls return; :func:`call_watched` runs a call on the calling
thread, timed out by a :class:`Watchdog` at the same bound; :func:`settled` joins futures.
Nothing here knows Mooncake: the direct transfer path uses the same bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["CallOutcome", "CallRunner", "SpanBudget", "StartedCall", "Watchdog", "call_bounded",
           "call_watched", "default_runner", "settled", "start_call", "start_call_threads",
           "wait_until_returned"]


class CallRunner:
    """Daemon threads that run blocking calls: an idle thread takes the next call, a new one
    starts when none is idle, so a stuck call never delays another. Up to ``max_idle``
    threads stay for later calls; the others end. Daemon threads: a call stuck at
    interpreter exit does not hold the exit up."""

    def __init__(self, name: str = "kvmove-call", max_idle: int = 8):
        self.name = name
        self.max_idle = max_idle
        self._reset()

    def _reset(self) -> None:
        """No thread, no call (a forked child's state: the parent's threads are not in it)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on a runner thread; its future."""
        future: Future = Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # an idle thread will take this call
        self._queue.put((future, fn, args))
        if start:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
        return future

    def start_idle(self, n: int) -> None:
        """Start threads until ``n`` are idle (at most ``max_idle``): for a caller about to
        serve, so that its first calls start none (a thread start costs the call ~0.1 ms).
        ``RuntimeError`` where no more threads can be started."""
        with self._lock:
            add = max(0, min(n, self.max_idle) - self._idle)
        for _ in range(add):
            threading.Thread(target=self._work, name=self.name, daemon=True).start()
            with self._lock:  # counted once started: each takes a call from the queue
                self._idle += 1

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the waiter
                    future.set_exception(e)
            del future, fn, args
            with self._lock:
                if self._idle >= self.max_idle:
                    return
                self._idle += 1


_RUNNER = CallRunner()


def default_runner() -> CallRunner:
    """The process's runner (shared by every store)."""
    return _RUNNER


@dataclass(slots=True)
class CallOutcome:
    """``done``: the call returned in time (``value`` is its result, or ``error`` what it
    raised); otherwise ``late`` completes when it really returns."""

    done: bool
    value: object = None
    error: BaseException | None = None
    late: Future | None = None
    seconds: float = 0.0


class StartedCall:
    """A call running on a runner since ``started`` (``time.monotonic()``), whose outcome is
    taken later: the caller does other work meanwhile."""

    __slots__ = ("future", "started")

    def __init__(self, future: Future, started: float):
        self.future = future
        self.started = started

    def outcome(self, timeout: float) -> CallOutcome:
        """Wait until at most ``timeout`` seconds after the call started (not after this
        wait began); a call still running then is late."""
        future, t0 = self.future, self.started
        try:
            value = future.result(max(0.0, timeout - (time.monotonic() - t0)))
        except FutureTimeout:
            return CallOutcome(False, late=future, seconds=time.monotonic() - t0)
        except Exception as e:
            return CallOutcome(True, error=e, seconds=time.monotonic() - t0)
        except BaseException:
            # Interrupted on this thread (a signal's KeyboardInterrupt): the frames above
            # free the call's memory as the exception passes them, and the call still
            # writes into it (a get) or reads it (a put). It goes on once the call returned.
            if not future.done():
                with contextlib.suppress(BaseException):  # a second signal: this one goes on
                    wait_until_returned(future)
                log.warning(_INTERRUPTED)
            raise
        return CallOutcome(True, value=value, seconds=time.monotonic() - t0)


def wait_until_returned(*futures: Future) -> None:
    """Wait until every one of ``futures`` (calls, or calls that timed out) is done, for a caller
    about to free or hand back memory they use. A signal's exception meanwhile does not cut
    the wait short (Mooncake caps its calls at 60 s): the first is raised once they are all
    done."""
    interrupted = None
    for future in futures:
        while not future.done():
            try:
                futures_wait([future])
            except BaseException as e:
                interrupted = interrupted or e
    if interrupted is not None:
        log.warning(_INTERRUPTED)
        raise interrupted


_INTERRUPTED = ("interrupted while a native call ran: the interruption went on once the call "
                "had returned (it used memory that is released then)")


def start_call(fn: Callable, *args, runner: CallRunner | None = None,
               on_return: Callable[[], None] | None = None) -> StartedCall:
    """Start ``fn(*args)`` on ``runner``; :meth:`StartedCall.outcome` waits for it, bounded.
    ``on_return`` runs when the call has really returned, in time or late (e.g. to release
    its spans)."""
    t0 = time.monotonic()
    future = (runner or _RUNNER).submit(fn, *args)
    if on_return is not None:
        future.add_done_callback(lambda _f: on_return())
    return StartedCall(future, t0)


def call_bounded(fn: Callable, *args, timeout: float, runner: CallRunner | None = None,
                 on_return: Callable[[], None] | None = None) -> CallOutcome:
    """Run ``fn(*args)`` on ``runner`` and wait at most ``timeout`` seconds.
    ``on_return`` runs when the call has really returned, in time or late (e.g. to release
    its spans)."""
    return start_call(fn, *args, runner=runner, on_return=on_return).outcome(timeout)


IDLE_TICK_S = 1.0  # the watchdog's tick while calls come and go (Watchdog)


class Watchdog:
    """One daemon thread that times out calls that have not returned in time: a caller
    :meth:`arm` s its call (a token) with what to do then, and :meth:`disarm` s it when the
    call returns; past the call's timeout the watchdog runs ``on_late()`` on its own
    thread (the call itself runs on to its end on the caller's). ``timeout`` is
    :meth:`arm`'s default. The thread sleeps until the first deadline armed, so a call that
    returns in time costs it no wake-up of its own. With nothing armed it sleeps
    :data:`IDLE_TICK_S` while calls come and go (else a call armed after the last one
    returned, the hot path's one call at a time, would wake it: a thread switch and a GIL
    hand-off beside the call), and without end once a tick passed with none armed; a call
    armed then, or one due before the thread wakes, wakes it."""

    def __init__(self, timeout: float | None = None, name: str = "kvmove-watchdog"):
        self.timeout = timeout
        self.name = name
        self._reset()

    def _reset(self) -> None:
        """Nothing armed, no thread (a forked child's state: the parent's thread is not in
        it)."""
        self._armed: dict[object, tuple[float, Callable[[], None]]] = {}
        # arm/disarm take the lock itself (a C lock: twice per watched call); the thread
        # waits on the condition
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._wakes_at = float("inf")  # when the thread wakes next (inf: when notified)
        self._armed_lately = False  # a call was armed since the thread last looked
        self._stopped = False

    def arm(self, token: object, on_late: Callable[[], None],
            timeout: float | None = None) -> None:
        """Watch the call ``token`` from now on: ``on_late()`` runs if it is not disarmed
        within ``timeout`` seconds (default :attr:`timeout`)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._armed[token] = (deadline, on_late)
            self._armed_lately = True
            if self._thread is None:
                self._start_thread()
            if deadline < self._wakes_at:
                self._wakes_at = deadline
                self._cond.notify()

    def start(self) -> None:
        """Start the thread now, for a caller about to serve (else the first call armed
        starts it)."""
        with self._lock:
            if self._thread is None:
                self._start_thread()

    def _start_thread(self) -> None:  # the lock held
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        thread.start()
        self._thread = thread

    def disarm(self, token: object) -> bool:
        """The call ``token`` returned: True when in time, False when the watchdog timed
        it out (its ``on_late`` has run, runs, or is about to run on the watchdog's
        thread)."""
        with self._lock:
            return self._armed.pop(token, None) is not None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                late = [t for t, (deadline, _) in self._armed.items() if deadline <= now]
                late = [self._armed.pop(t)[1] for t in late]
                if not late:
                    if self._armed:
                        self._wakes_at = min(d for d, _ in self._armed.values())
                    elif self._armed_lately:  # calls come and go: tick while they do
                        self._wakes_at = now + IDLE_TICK_S
                    else:  # none since the last tick: sleep until one is armed
                        self._wakes_at = float("inf")
                    self._armed_lately = False
                    self._cond.wait(None if self._wakes_at == float("inf")
                                    else self._wakes_at - now)
                    continue
            for on_late in late:
                try:
                    on_late()
                except Exception:  # the watchdog stays up for the other calls
                    log.exception("a watchdog's on_late raised")


_WATCHDOG = Watchdog(name="kvmove-call-watchdog")


def _reset_after_fork() -> None:
    _RUNNER._reset()
    _WATCHDOG._reset()
    _LateFuture._lock = threading.Lock()  # a parent's thread may have held it at the fork


# A child forked by a process that made calls would otherwise count idle threads and a
# watchdog thread that it does not have: its calls would wait for ever.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def start_call_threads(idle_runners: int) -> None:
    """Start, before serving, the threads that store calls run on: runner threads until
    ``idle_runners`` are idle (at most the runner's ``max_idle``, shared by the process)
    and the watchdog of calls made on their caller's thread (a call that started one paid
    ~0.1 ms for it)."""
    _RUNNER.start_idle(idle_runners)
    _WATCHDOG.start()


class _LateFuture:
    """The future of a watched call that timed out, made by whichever of the watchdog
    and the caller wants it first: a call that returns in time makes none (a future's
    condition and its wake-up cost a visible part of a hot call)."""

    __slots__ = ("_future",)
    # One lock for every token: only a call that timed out takes it (a lock made per call
    # is a cost on every call's hot path).
    _lock = threading.Lock()

    def __init__(self):
        self._future: Future | None = None

    def get(self) -> Future:
        with _LateFuture._lock:
            if self._future is None:
                self._future = Future()
            return self._future


def call_watched(fn: Callable, *args, timeout: float,
                 on_late: Callable[[Future], None] | None = None,
                 watchdog: Watchdog | None = None) -> CallOutcome:
    """Run ``fn(*args)`` on this thread, watched: if it has not returned within ``timeout``
    seconds, ``on_late(late)`` runs then, on the watchdog's thread, with a future that
    completes when ``fn`` returns (as :func:`start_call`'s would for a call that timed out), and
    the outcome, taken once ``fn`` has returned, is that of a call that timed out (``done`` False,
    ``late`` completed with what ``fn`` returned or raised). Returns only when ``fn`` has:
    for callers that would wait for a call in flight anyway."""
    token = _LateFuture()
    dog = watchdog or _WATCHDOG
    dog.arm(token, (lambda: on_late(token.get())) if on_late is not None else (lambda: None),
            timeout)
    t0 = time.monotonic()
    try:
        value = fn(*args)
    except Exception as e:
        if dog.disarm(token):
            return CallOutcome(True, error=e, seconds=time.monotonic() - t0)
        late = token.get()
        late.set_exception(e)
        return CallOutcome(False, late=late, seconds=time.monotonic() - t0)
    except BaseException as e:
        if not dog.disarm(token):
            token.get().set_exception(e)
        raise
    if dog.disarm(token):
        return CallOutcome(True, value=value, seconds=time.monotonic() - t0)
    late = token.get()
    late.set_result(value)
    return CallOutcome(False, late=late, seconds=time.monotonic() - t0)


def settled(futures: Iterable[Future | None]) -> Future | None:
    """One future that completes when every one of ``futures`` has (``None`` when there are
    none left running)."""
    pending = [f for f in futures if f is not None and not f.done()]
    if not pending:
        return None
    if len(pending) == 1:
        return pending[0]
    joined: Future = Future()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_f) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            joined.set_result(None)

    for f in pending:
        f.add_done_callback(one_done)
    return joined


class SpanBudget:
    """Spans (transfer requests) in flight on one client: :meth:`acquire` before a call,
    :meth:`release` when the call has really returned."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()  # taken as it is where nobody waits (the usual case)
        self._cond = threading.Condition(self._lock)
        self._used = 0
        self._releases = 0  # progress: calls that returned
        self._waiting = 0  # acquires waiting for room

    def acquire(self, spans: int, timeout: float) -> int:
        """Wait until ``spans`` (at most ``limit``) are free and take them; the number taken,
        or 0 when no call returned for ``timeout`` seconds while waiting (the transport
        made no progress: calls that return, even slowly, keep a waiter waiting)."""
        want = max(1, min(spans, self.limit))
        with self._lock:
            if self._used + want <= self.limit:  # room: no wait
                self._used += want
                return want
            self._waiting += 1
            try:
                seen = self._releases
                deadline = time.monotonic() + timeout
                while self._used + want > self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if self._releases == seen:
                            return 0
                        seen, deadline = self._releases, time.monotonic() + timeout
                        continue
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
            self._used += want
        return want

    def release(self, spans: int) -> None:
        with self._lock:
            self._used -= spans
            self._releases += 1
            if self._waiting:
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._used
