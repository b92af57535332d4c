"""Whether ``(address, nbytes)`` regions are memory this process may read and write: host
memory mapped read+write (``/proc/self/maps``, read once per question: a register-time
check, never a per-call one) or CUDA device memory (:func:`kvmove.memory.cuda_api.device_range`).
A region handed in as raw numbers is checked this way before a store registers it: a
transfer into memory that is not there kills the process inside Mooncake."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["check_mapped", "parse_maps", "unusable"]

MAPS = "/proc/self/maps"


def parse_maps(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The read+write ranges of a ``/proc/<pid>/maps`` text as sorted ``(starts, ends)``
    (uint64), neighbours that touch merged into one range."""
    ranges = []
    for line in text.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) >= 2 and fields[1][:2] == "rw":
            lo, _, hi = fields[0].partition("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    ranges.sort()
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    starts = np.array([m[0] for m in merged], dtype=np.uint64)
    ends = np.array([m[1] for m in merged], dtype=np.uint64)
    return starts, ends


def _host_maps() -> tuple[np.ndarray, np.ndarray] | None:
    try:
        with open(MAPS) as f:
            return parse_maps(f.read())
    except OSError:  # not Linux: nothing to check against
        return None


def _inside(starts: np.ndarray, ends: np.ndarray, address: int, nbytes: int) -> bool:
    i = int(np.searchsorted(starts, np.uint64(address), side="right")) - 1
    return i >= 0 and address + nbytes <= int(ends[i])


def unusable(regions: Iterable[tuple[int, int]], maps: tuple[np.ndarray, np.ndarray] | None
             = None) -> tuple[int, int] | None:
    """The first region that is neither mapped read+write host memory (``maps``: as
    :func:`parse_maps` gives, default this process's) nor CUDA device memory; None when
    every one is usable (or when this system has no ``/proc/self/maps``)."""
    regions = [(int(a), int(n)) for a, n in regions]
    if not regions:
        return None
    if maps is None:
        maps = _host_maps()
        if maps is None:
            log.debug("no %s here: raw regions are not checked", MAPS)
            return None
    starts, ends = maps
    for address, nbytes in regions:
        if nbytes <= 0 or address <= 0 or address + nbytes > 1 << 64:
            return address, nbytes
        if _inside(starts, ends, address, nbytes) or _on_device(address, nbytes):
            continue
        return address, nbytes
    return None


def _on_device(address: int, nbytes: int) -> bool:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False  # no CUDA memory can exist in this process
    from kvmove.memory.cuda_api import device_range

    found = device_range(address)
    return found is not None and address + nbytes <= found[0] + found[1]


def check_mapped(regions: Iterable[tuple[int, int]]) -> None:
    """``ValueError`` naming the first region of ``regions`` that :func:`unusable` finds."""
    bad = unusable(regions)
    if bad is not None:
        address, nbytes = bad
        raise ValueError(
            f"region {address:#x} + {nbytes} bytes is not memory of this process (neither "
            f"host memory mapped read+write nor CUDA device memory): a transfer there would "
            f"crash the process"
        )
