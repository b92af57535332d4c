"""Whether the spans of descriptors lie inside known memory regions, each span inside ONE
region (a span that runs past a region's end is outside, whatever follows it): one
``searchsorted`` over the sorted region starts for all spans, no Python loop per span. A
store checks raw descriptors (built from lists) this way before Mooncake sees them."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["check_spans", "first_outside"]

_LIMIT = 1 << 64


def first_outside(ptrs: Sequence[int], sizes: Sequence[int],
                  regions: Iterable[tuple[int, int]]) -> int | None:
    """The index of the first span ``(ptrs[i], sizes[i])`` that lies inside none of the
    disjoint ``(address, nbytes)`` ``regions``; None when every span lies inside one."""
    table = sorted((int(a), int(n)) for a, n in regions)
    try:
        p = np.fromiter(ptrs, dtype=np.uint64, count=len(ptrs))
        s = np.fromiter(sizes, dtype=np.uint64, count=len(sizes))
    except (OverflowError, ValueError):  # a value no address can have: find it
        return next((i for i, (a, n) in enumerate(zip(ptrs, sizes, strict=True))
                    if not 0 < a < _LIMIT or not 0 < n < _LIMIT), 0)
    if not table:
        return 0 if p.size else None
    starts = np.array([a for a, _ in table], dtype=np.uint64)
    ends = np.array([min(a + n, _LIMIT - 1) for a, n in table], dtype=np.uint64)
    idx = np.searchsorted(starts, p, side="right").astype(np.int64) - 1
    end = ends[np.maximum(idx, 0)]
    # ``end - p`` wraps where p >= end; those spans fail ``p < end`` first.
    ok = (idx >= 0) & (p < end) & (s <= end - p)
    if ok.all():
        return None
    return int(np.argmin(ok))


def check_spans(keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                sizes: Sequence[Sequence[int]], regions: Iterable[tuple[int, int]],
                what: str = "memory this store has registered") -> None:
    """``ValueError`` naming the key, the address and the size of the first span of these
    descriptors that lies inside none of ``regions``."""
    flat_p = list(itertools.chain.from_iterable(ptrs))
    flat_s = list(itertools.chain.from_iterable(sizes))
    bad = first_outside(flat_p, flat_s, regions)
    if bad is None:
        return
    counts = np.cumsum([len(row) for row in ptrs])
    key = keys[int(np.searchsorted(counts, bad, side="right"))]
    raise ValueError(
        f"key {key!r}: span {flat_p[bad]:#x} + {flat_s[bad]} bytes does not lie inside one "
        f"region of {what} (register the memory first, or describe it with "
        f"kvmove.describe()); nothing was sent"
    )
