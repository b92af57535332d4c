"""A thread-safe allocator of staging slot ids that prefers the lowest free slots
(so fresh allocations come out as contiguous runs, which the copy paths exploit)."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from kvmove.checks import as_int_array, has_repeats
from kvmove.errors import StagingFull


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = np.ones(num_slots, dtype=bool)
        self._num_free = num_slots
        self._cond = threading.Condition()

    @property
    def num_free(self) -> int:
        with self._cond:
            return self._num_free

    def wait_all_free(self, timeout: float | None = 0.0) -> bool:
        """Wait up to ``timeout`` seconds (``None``: forever) until no slot is allocated;
        whether none is."""
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while self._num_free < self.num_slots:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def alloc(self, n: int, *, timeout: float | None = 0.0) -> torch.Tensor:
        """``n`` free slot ids (int64, ascending). With ``timeout`` 0 (the default) raise
        :class:`StagingFull` at once when fewer than ``n`` are free; with a positive timeout
        wait that long for slots to be freed; ``None`` waits forever. Allocates nothing on
        failure."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        n = int(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_slots:
            raise StagingFull(f"asked for {n} slots, the staging has only {self.num_slots}")
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while self._num_free < n:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise StagingFull(
                        f"asked for {n} slots, {self._num_free} of {self.num_slots} are free"
                    )
                self._cond.wait(remaining)
            slots = np.flatnonzero(self._free)[:n]
            self._free[slots] = False
            self._num_free -= n
        return torch.from_numpy(slots.astype(np.int64))

    def free(self, slots) -> None:
        """Return ``slots`` to the pool. A slot that is not allocated, out of range or named
        twice raises ``ValueError`` and nothing is freed."""
        ids = as_int_array(slots, "slots")
        if ids.size == 0:
            return
        bad = (ids < 0) | (ids >= self.num_slots)
        if bad.any():
            raise ValueError(f"slots out of range 0..{self.num_slots - 1}: {ids[bad][:8].tolist()}")
        if has_repeats(ids):
            raise ValueError(f"slots named twice in one free(): {ids.tolist()[:16]}")
        with self._cond:
            not_allocated = self._free[ids]
            if not_allocated.any():
                raise ValueError(
                    f"freeing slots that are not allocated: {ids[not_allocated][:8].tolist()}"
                )
            self._free[ids] = True
            self._num_free += ids.size
            self._cond.notify_all()

