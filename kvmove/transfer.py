"""``Transfer``: the handle of one evict or prefetch running in the background."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from kvmove.status import Status


class CompletedEvent:
    """Stands in for a CUDA event on a machine without one: the work it marks is done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


@dataclass
class StageTimes:
    """Seconds spent per stage of one transfer (host-side wall clock)."""

    gather: float = 0.0
    put: float = 0.0
    get: float = 0.0
    scatter: float = 0.0


@dataclass
class TransferResult:
    statuses: list[Status]
    codes: list[int]
    nbytes: int  # bytes of the objects moved successfully
    times: StageTimes = field(default_factory=StageTimes)


class Transfer:
    """One evict or prefetch. ``wait()`` gives one :class:`Status` per key.

    - ``gathered`` (evict): an event after which the engine may overwrite the evicted KV
      rows (a ``torch.cuda.Event`` on CUDA; on CPU the gather finished before ``evict``
      returned and this is an already-completed stand-in).
    - ``wait_layer(l)`` (prefetch): returns once layer ``l`` of every OK key is in the KV
      cache (on CUDA: once the engine's current stream has been made to wait for it).
    - ``scattered`` (prefetch): an event after which every OK key's rows are in the KV
      cache; valid once ``wait()`` has returned (a ``torch.cuda.Event`` on CUDA,
      ``scattered.wait()`` orders the current stream after it; on CPU an
      already-completed stand-in).
    """

    def __init__(self, keys: list[str], future: Future, *, kind: str, num_layers: int,
                 gathered=None):
        self.keys = keys
        self.kind = kind
        self.gathered = gathered if gathered is not None else CompletedEvent()
        self.scattered = CompletedEvent()  # the mover records the scatter's event, on CUDA
        self._future = future
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._layer_events: list = [None] * num_layers  # CUDA events, when on CUDA

    # -- for the mover --------------------------------------------------------------------
    def _layer_done(self, layer: int, cuda_event=None) -> None:
        self._layer_events[layer] = cuda_event
        self._layers[layer].set()

    def _all_layers_done(self) -> None:
        for e in self._layers:
            e.set()

    # -- for the engine -------------------------------------------------------------------
    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> list[Status]:
        """Block until the transfer ends; one status per key. Raises ``TimeoutError`` if it
        has not ended within ``timeout`` seconds."""
        return self.result(timeout).statuses

    def result(self, timeout: float | None = None) -> TransferResult:
        """Statuses, raw Mooncake codes, bytes moved and per-stage times."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"{self.kind} of {len(self.keys)} keys still running") from None

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        if not isinstance(layer, int) or not 0 <= layer < len(self._layers):
            raise IndexError(f"layer must be in 0..{len(self._layers) - 1}, got {layer!r}")
        if not self._layers[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} of the {self.kind} is not in the KV cache yet")
        event = self._layer_events[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        if self._future.done() and self._future.exception() is not None:
            raise self._future.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"Transfer({self.kind}, {len(self.keys)} keys, {state})"
