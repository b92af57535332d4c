"""The timer: every figure is the median of interleaved repeats after warm-up runs; CUDA
events on a GPU, the monotonic clock on the CPU.

Methods of one case are timed round-robin (the order rotating each repeat), so a change in
the machine's load during the run hits every method alike and the ratios stay fair.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    samples: list[float]  # seconds, one per repeat

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median over the repeats: how noisy the figure is."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, its device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # an idle device: the events see the host's prologue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(fns: dict[str, Callable[[], object]], *, device: torch.device, warmup: int,
            repeats: int) -> dict[str, Timing]:
    """Warm every function up ``warmup`` times, then time each ``repeats`` times,
    interleaved. Returns a :class:`Timing` per name."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            samples[name].append(time_once(fns[name], device))
    return {name: Timing(s) for name, s in samples.items()}
