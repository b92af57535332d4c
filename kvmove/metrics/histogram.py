"""A histogram cheap enough for a caller's thread: an observation is one append to a
deque (thread-safe, no lock, no search); the values are sorted into their buckets when
read (a scrape) or when 65536 are pending."""

from __future__ import annotations

import bisect
import threading
from collections import deque

# Seconds, from 1 µs (a call's host time) to 10 s (a store call at its bound).
SECONDS_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
                   1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
PROGRAMS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 132, 264, 528, 1056)
_FOLD_AT = 1 << 16


class Buckets:
    """Counts per bucket (upper bounds ``bounds``, then +Inf) and their sum, of values
    observed in units of ``scale`` (e.g. ns observed, seconds exported: ``scale=1e-9``)."""

    def __init__(self, bounds: tuple[float, ...], scale: float = 1.0):
        self.bounds = tuple(b / scale for b in bounds)  # in the observed unit
        self.scale = scale
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.pending: deque = deque()
        self._lock = threading.Lock()

    def observe(self, value) -> None:
        pending = self.pending
        pending.append(value)
        if len(pending) > _FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Sort the pending values into the counts."""
        pending, bounds, find = self.pending, self.bounds, bisect.bisect_left
        with self._lock:
            counts, total = self.counts, 0
            for _ in range(len(pending)):
                value = pending.popleft()
                counts[find(bounds, value)] += 1
                total += value
            self.total += total * self.scale

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative ``(upper bound, count)`` pairs, +Inf last, and the sum (exported
        units)."""
        self.fold()
        with self._lock:
            counts, total = list(self.counts), self.total
        out, running = [], 0
        labels = (*(repr(float(b * self.scale)) for b in self.bounds), "+Inf")
        for bound, c in zip(labels, counts, strict=True):
            running += c
            out.append((bound, running))
        return out, total
