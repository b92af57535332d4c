"""The timer: every figure is the median of interleaved repeats after warm-up runs; CUDA
events on a GPU, the monotonic clock on the CPU.

Methods of one case are timed in turn, in an order that changes each repeat, so a change in
the machine's load during the run hits every method alike, and no method always follows the
same one (a rotation would: a method that always comes after a long serial loop finds
torch's OpenMP threads asleep every time, one that follows a parallel copy finds them awake).
The orders are the rows of a Williams square (:func:`repeat_order`): over ``n`` repeats
(``2n`` for an odd number of methods) each method comes at each place, and right after each
other method, equally often. A sample of a short call is several calls back to back (about
``min_sample_s`` long): one call of a few hundred microseconds measures the machine's other
work (a preemption, an OpenMP straggler) more than the call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    samples: list[float]  # seconds per call, one per repeat
    calls: int = 1  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median over the repeats: how noisy the figure is."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_once(fn: Callable[[], object], device: torch.device, calls: int = 1) -> float:
    """Seconds one call of ``fn`` takes (the mean of ``calls`` back to back), its device
    work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an idle device: the events see the host's prologue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def repeat_order(names: list[str], repeat: int) -> list[str]:
    """The order of the methods in repeat ``repeat``: row ``repeat`` of a Williams square
    (first row ``0, 1, n-1, 2, n-2, ...``, each next row every index plus one; for an odd
    ``n`` the mirrored rows follow), balanced for the place of each method and for the one
    before it."""
    n = len(names)
    if n < 3:  # two methods: alternate which comes first
        return list(names) if repeat % 2 == 0 or n < 2 else list(reversed(names))
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = n if n % 2 == 0 else 2 * n
    k = repeat % rows
    row = first if k < n else first[::-1]
    return [names[(i + k) % n] for i in row]


def measure(fns: dict[str, Callable[[], object]], *, device: torch.device, warmup: int,
            repeats: int, min_sample_s: float = 0.0, max_calls: int = 1000
            ) -> dict[str, Timing]:
    """Warm every function up ``warmup`` times, then time each ``repeats`` times,
    interleaved; a sample is as many calls back to back (at most ``max_calls``) as make
    about ``min_sample_s`` seconds, the same count for every function of the case (the
    slowest one's). Returns a :class:`Timing` per name."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calls = 1
    if min_sample_s > 0 and names:
        slowest = max(time_once(fns[name], device) for name in names)
        calls = max(1, min(max_calls, int(min_sample_s / max(slowest, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in repeat_order(names, r):
            samples[name].append(time_once(fns[name], device, calls))
    return {name: Timing(s, calls) for name, s in samples.items()}
