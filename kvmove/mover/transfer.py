"""``Transfer``: the handle of one evict or prefetch running in the background."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as concurrent_wait
from dataclasses import dataclass, field

import torch

from kvmove.errors import KVMoveError
from kvmove.status import Status


class CompletedEvent:
    """Stands in for a CUDA event on a machine without one: the work it marks is done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


_COMPLETED = CompletedEvent()  # stateless: one for every transfer


class FutureEvent:
    """Stands in for a CUDA event where the work it marks is a background job on the host
    (an in-place put reading device rows): ``query()`` says whether it ended;
    ``synchronize()`` and ``wait(stream)`` block the host until it has (no stream can wait
    for host work, so ``wait`` waits here, whatever the stream)."""

    def __init__(self, future: Future):
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        concurrent_wait([self._future])

    def wait(self, stream=None) -> None:
        self.synchronize()


class StealableJob(Future):
    """A job queued for a worker that the first thread to wait for it without a timeout
    runs itself when no worker has started it (a bounded waiter only waits). Runs exactly
    once; a waiter's run is inside ``guard()`` (the mover counts it for ``close()``; a
    guard that yields ``False`` refuses, and the job runs on its worker).
    ``for_layer_waiters=False``: ``Transfer.wait_layer`` never runs it (a layer-by-layer
    job: its waiter wants the first layer while a worker scatters the next).
    A :class:`~concurrent.futures.Future` for everything else."""

    def __init__(self, fn, guard, *, for_layer_waiters: bool = True):
        super().__init__()
        self._fn, self._guard = fn, guard
        self.for_layer_waiters = for_layer_waiters
        self._claimed = False

    def _claim(self) -> bool:
        with self._condition:  # the future's own lock: no second lock made per job
            claimed, self._claimed = self._claimed, True
        return not claimed

    def _execute(self) -> None:
        fn, self._fn = self._fn, None  # the job's arguments are not kept alive once it ran
        self.set_running_or_notify_cancel()
        try:
            self.set_result(fn())
        except BaseException as e:  # surfaced by result(), as a worker's would be
            self.set_exception(e)

    def run(self) -> None:
        """The worker's entry: run the job unless a waiter has."""
        if self._claim():
            self._execute()

    def steal(self) -> None:
        """Run the job here unless a worker (or another waiter) has started it."""
        if self._claimed:  # a worker (or another waiter) has it
            return
        with self._guard() as allowed:  # counted before the claim: close() waits for it
            if allowed is not False and self._claim():
                self._execute()

    def result(self, timeout=None):
        if timeout is None:  # a bounded wait must not run the job: it may take longer
            self.steal()
        return super().result(timeout)


@dataclass
class StageTimes:
    """Seconds spent per stage of one transfer (host-side wall clock)."""

    gather: float = 0.0
    put: float = 0.0
    get: float = 0.0
    scatter: float = 0.0

    def add(self, other: StageTimes) -> None:
        self.gather += other.gather
        self.put += other.put
        self.get += other.get
        self.scatter += other.scatter


@dataclass
class TransferResult:
    statuses: list[Status]
    codes: list[int]
    nbytes: int  # bytes of the objects moved successfully
    times: StageTimes = field(default_factory=StageTimes)


def join_results(parts: list[TransferResult]) -> TransferResult:
    """The results of consecutive pieces of one call, as one."""
    if len(parts) == 1:
        return parts[0]
    joined = TransferResult([], [], 0)
    for r in parts:
        joined.statuses += r.statuses
        joined.codes += r.codes
        joined.nbytes += r.nbytes
        joined.times.add(r.times)
    return joined


class LayerProgress:
    """Which layers of a prefetch are in the KV cache, without one object per layer: layers
    complete in order, so a count (and, on CUDA, the event recorded after the scatter of
    each layer's group) says it all. ``finish()`` releases every waiter (the transfer ended)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._done = 0  # layers 0 .. _done - 1 are enqueued (CUDA) or copied (CPU)
        self._events: list = []  # CUDA event after layer i's group (None on the CPU)
        self._finished = False
        self._all_event = None  # CUDA event after the whole scatter

    # -- the mover ------------------------------------------------------------------------
    def layers_done(self, upto: int, event=None) -> None:
        """Layers ``0 .. upto - 1`` are done (those not reported yet: after ``event``)."""
        with self._cond:
            self._events += [event] * (upto - self._done)
            self._done = upto
            self._cond.notify_all()

    def all_done(self, event=None) -> None:
        """Every layer is in place (the last event covers them all): the transfer has
        finished placing layers, so a ``finish()`` after it has nothing left to do."""
        with self._cond:
            self._all_event = event
            self._done = self.num_layers
            self._finished = True
            self._cond.notify_all()

    def finish(self) -> None:
        if self._finished:  # all_done() came first (set by the same job's thread)
            return
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    # -- waiters --------------------------------------------------------------------------
    def wait(self, layer: int | None, timeout: float | None) -> tuple[bool, object]:
        """Wait until ``layer`` (``None``: all) is done or the transfer finished; returns
        (reached, the CUDA event to wait on or None)."""
        want = self.num_layers if layer is None else layer + 1
        with self._cond:
            if not self._cond.wait_for(lambda: self._done >= want or self._finished, timeout):
                return False, None
            if layer is not None and layer < len(self._events):
                return True, self._events[layer]
            return True, self._all_event if self._done >= want else None

    def layer_in_place(self, layer: int | None) -> bool:
        """Whether ``layer`` (``None``: all) was reported done (enqueued on CUDA, copied on
        the CPU); False after a ``finish()`` that came first (the job failed)."""
        with self._cond:
            return self._done >= (self.num_layers if layer is None else layer + 1)

    def reached(self, layer: int | None) -> bool:
        with self._cond:
            return self._finished or self._done >= (
                self.num_layers if layer is None else layer + 1)


class ScatterEvent:
    """The completion of a prefetch's scatter, usable where a CUDA event is: ``wait(stream)``
    (so ``stream.wait_event(t.scattered)`` works), ``synchronize()``, ``query()``. The
    scatter is enqueued by a worker (or a waiter) once the get has finished, so ``wait`` and
    ``synchronize`` first wait on the host for that; on the CPU they return once the rows
    are copied."""

    def __init__(self, progress: LayerProgress, device: torch.device):
        self.progress = progress
        self._device = device

    def _event(self):
        return self.progress.wait(None, None)[1]

    def wait(self, stream=None) -> None:
        event = self._event()
        if event is not None:
            if stream is None:
                stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)

    def synchronize(self) -> None:
        event = self._event()
        if event is not None:
            event.synchronize()

    def query(self) -> bool:
        if not self.progress.reached(None):
            return False
        event = self._event()
        return True if event is None else event.query()


class Transfer:
    """One evict or prefetch. ``wait()`` gives one :class:`Status` per key, in order (a
    call run in pieces joins their results). ``gathered`` (evict): an event after which
    the engine may overwrite the evicted rows (a completed stand-in on the CPU).
    ``scattered`` (prefetch): event-like, after which every ``OK`` key's rows are in the
    cache. ``wait_layer(l)`` (prefetch): once layer ``l`` of every OK key is in place (on
    CUDA the current stream is made to wait for it). ``docs/API.md``, "KVMover"."""

    def __init__(self, keys: list[str], *, kind: str, num_layers: int,
                 device: torch.device | None = None):
        self.keys = keys
        self.kind = kind
        self.device = device if device is not None else torch.device("cpu")
        self.gathered = _COMPLETED
        self._pieces: list[tuple[int, Future | TransferResult]] = []  # (first key, result)
        self.progress = LayerProgress(num_layers)
        self._scattered = None  # made when first asked for (most callers never do)

    @property
    def scattered(self) -> ScatterEvent:
        if self._scattered is None:  # two racing threads make equal ones: either serves
            self._scattered = ScatterEvent(self.progress, self.device)
        return self._scattered

    # -- for the mover --------------------------------------------------------------------
    def add_piece(self, first: int, piece: Future | TransferResult) -> None:
        """Add the result (or the future result) of the piece whose first key is
        ``first``."""
        self._pieces.append((first, piece))

    # -- for the engine -------------------------------------------------------------------
    def done(self) -> bool:
        return all(not isinstance(p, Future) or p.done() for _, p in self._pieces)

    def wait(self, timeout: float | None = None) -> list[Status]:
        """Block until the transfer ends; one status per key. Raises ``TimeoutError`` if it
        has not ended within ``timeout`` seconds."""
        return self.result(timeout).statuses

    def result(self, timeout: float | None = None) -> TransferResult:
        """Statuses, raw Mooncake codes, bytes moved and per-stage times."""
        parts = []
        for _, piece in sorted(self._pieces, key=lambda p: p[0]):
            if isinstance(piece, Future):
                try:
                    piece = piece.result(timeout)
                except FutureTimeout:
                    raise TimeoutError(
                        f"{self.kind} of {len(self.keys)} keys still running") from None
            parts.append(piece)
        return join_results(parts)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        n = self.progress.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise IndexError(f"layer must be in 0..{n - 1}, got {layer!r}")
        if timeout is None:  # a job no worker has started yet: run it here (unbounded only)
            for _, piece in self._pieces:
                if isinstance(piece, StealableJob) and piece.for_layer_waiters:
                    piece.steal()
        reached, event = self.progress.wait(layer, timeout)
        if not reached:
            raise TimeoutError(f"layer {layer} of the {self.kind} is not in the KV cache yet")
        if not self.progress.layer_in_place(layer):
            # The background job ended without placing this layer: it raised. It wakes the
            # waiters (in its ``finally``) before its future holds the exception, so wait
            # for the future here and raise what the job raised: never return as if the
            # layer were in the KV cache.
            self.result(timeout)
            raise KVMoveError(f"the {self.kind} ended before layer {layer} was scattered")
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        for _, piece in self._pieces:
            if isinstance(piece, Future) and piece.done() and piece.exception() is not None:
                raise piece.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"Transfer({self.kind}, {len(self.keys)} keys, {state})"
