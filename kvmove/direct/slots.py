"""Staging slots of a sender, taken layer by layer.

A send of every layer takes slots whose every layer is free; a send of one layer takes
slots whose that layer is free: the layers of a slot are separate memory, so a layer-wise
prefill of ``n`` pages streams through ``n`` slots, not ``n`` per layer in flight. The
lowest free slots go first (fresh slots come out as contiguous runs, which merge into long
spans). Thread-safe. Once closed nothing more is taken; what is held still comes back, and
the last slot back can run a callback (the sender frees its staging then).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvmove.errors import KVMoveError, StagingFull

log = logging.getLogger(__name__)


class SlotsClosed(KVMoveError):
    """:meth:`LayerSlots.alloc` after (or while waiting when) :meth:`LayerSlots.close` was
    called."""


class LayerSlots:
    def __init__(self, num_layers: int, num_slots: int):
        self.num_slots = num_slots
        self._free = np.ones((num_layers, num_slots), dtype=bool)
        self._cond = threading.Condition()
        self._closed = False
        self._on_all_free = None  # run once when the last slot held comes back

    def _candidates(self, layer: int | None) -> np.ndarray:
        return self._free.all(axis=0) if layer is None else self._free[layer]

    def alloc(self, n: int, layer: int | None, *, timeout: float | None) -> np.ndarray:
        """``n`` slot ids (int64, ascending) free in ``layer`` (``None``: in every layer),
        waiting up to ``timeout`` seconds (``None``: for ever) for them; else
        :class:`kvmove.StagingFull`, taking nothing; :class:`SlotsClosed` once closed (a
        wait in progress ends then too)."""
        if n > self.num_slots:
            raise StagingFull(f"asked for {n} slots, the staging has only {self.num_slots}")
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                if self._closed:
                    raise SlotsClosed("the staging is closed")
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
            done, self._on_all_free = self._take_done()
        if done is not None:
            _run(done)

    def close(self) -> None:
        """Take nothing more: :meth:`alloc` raises :class:`SlotsClosed`, waits in progress
        included. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def when_all_free(self, callback) -> bool:
        """Run ``callback()`` once every slot is free: now (True), or on the thread that
        frees the last slot held (False). Once only: call it after :meth:`close`."""
        with self._cond:
            self._on_all_free = callback
            done, self._on_all_free = self._take_done()
        if done is None:
            return False
        _run(done)
        return True

    def _take_done(self):
        """(the callback to run now, or None; what stays pending). Under ``_cond``."""
        if self._on_all_free is not None and bool(self._free.all()):
            return self._on_all_free, None
        return None, self._on_all_free

    def wait_all_free(self, timeout: float | None) -> bool:
        """Whether every slot of every layer is free within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._free.all()), timeout)


def _run(callback) -> None:
    try:
        callback()
    except Exception:  # on a sender's link thread: report, do not end the thread
        log.exception("the callback for the last staging slot back failed")
