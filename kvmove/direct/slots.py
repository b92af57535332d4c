"""Staging slots of a sender, taken layer by layer.

A send of every layer takes slots whose every layer is free; a send of one layer takes
slots whose that layer is free: the layers of a slot are separate memory, so a layer-wise
prefill of ``n`` pages streams through ``n`` slots, not ``n`` per layer in flight. The
lowest free slots go first (fresh slots come out as contiguous runs, which merge into long
spans). Thread-safe.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvmove.errors import StagingFull


class LayerSlots:
    def __init__(self, num_layers: int, num_slots: int):
        self.num_slots = num_slots
        self._free = np.ones((num_layers, num_slots), dtype=bool)
        self._cond = threading.Condition()

    def _candidates(self, layer: int | None) -> np.ndarray:
        return self._free.all(axis=0) if layer is None else self._free[layer]

    def alloc(self, n: int, layer: int | None, *, timeout: float | None) -> np.ndarray:
        """``n`` slot ids (int64, ascending) free in ``layer`` (``None``: in every layer),
        waiting up to ``timeout`` seconds (``None``: for ever) for them; else
        :class:`kvmove.StagingFull`, taking nothing."""
        if n > self.num_slots:
            raise StagingFull(f"asked for {n} slots, the staging has only {self.num_slots}")
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                free = np.flatnonzero(self._candidates(layer))
                if free.size >= n:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    where = "every layer" if layer is None else f"layer {layer}"
                    raise StagingFull(f"asked for {n} slots free in {where}, {free.size} of "
                                      f"{self.num_slots} are")
                self._cond.wait(left)
            slots = free[:n].astype(np.int64)
            if layer is None:
                self._free[:, slots] = False
            else:
                self._free[layer, slots] = False
        return slots

    def free(self, slots: np.ndarray, layer: int | None) -> None:
        """Give back what :meth:`alloc` took (the same ``layer``)."""
        with self._cond:
            rows = self._free[:, slots] if layer is None else self._free[layer, slots]
            if rows.any():
                raise ValueError(f"freeing staging slots that are free: {slots.tolist()[:8]}")
            if layer is None:
                self._free[:, slots] = True
            else:
                self._free[layer, slots] = True
            self._cond.notify_all()

    def wait_all_free(self, timeout: float | None) -> bool:
        """Whether every slot of every layer is free within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._free.all()), timeout)
