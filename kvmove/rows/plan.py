"""The plan of one row copy for the torch backend, worked out once per call in numpy for
every buffer and layer: which rows to copy (skips and out-of-range rows dropped, and
counted), which of them form whole pages that can move as units larger than a row, and
where either side is one run of consecutive rows (a memcpy per unit into a run).

A whole page is ``page_tokens`` rows that are the aligned run ``p * page_tokens ..`` on both
sides. :func:`plan_rows` finds them in row lists; :func:`plan_whole_pages` builds the plan
of a gather or scatter straight from its pages when every page is whole (a paged KV
cache), without row lists.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvmove.checks import SMALL_ROWS  # up to this many rows, Python lists cost less

# Pages move in units of at most this many bytes: torch's CPU index_select leaves its
# memcpy path at 32 KiB slices (2 GB/s instead of 8), and index_copy_ peaks near 16 KiB.
UNIT_BYTES = 16 << 10


def _as_numpy(rows: torch.Tensor) -> np.ndarray:
    """The values of an index tensor as a flat int64 numpy array (a view where possible)."""
    a = rows.detach().reshape(-1).cpu().numpy()
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _run_start(rows: np.ndarray) -> int | None:
    """``rows[0]`` if ``rows`` is ``rows[0], rows[0] + 1, ...`` (a run), else None."""
    if rows.size == 0:
        return None
    first = int(rows[0])
    if int(rows[-1]) - first != rows.size - 1:
        return None
    if rows.size > 2 and not bool((np.diff(rows) == 1).all()):
        return None
    return first


class Part:
    """One set of ``src[i] -> dst[i]`` copies in a unit (a row, or several rows)."""

    def __init__(self, src: np.ndarray, dst: np.ndarray,
                 runs: dict[str, int | None] | None = None):
        self.src, self.dst = src, dst
        self._runs: dict[str, int | None] = dict(runs or {})  # side -> first unit of its run
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}

    def __len__(self) -> int:
        return self.src.size

    def run(self, side: str) -> int | None:
        """The first unit of ``side`` ("src" or "dst") where that side is one run."""
        if side not in self._runs:
            self._runs[side] = _run_start(self.src if side == "src" else self.dst)
        return self._runs[side]

    def tensor(self, side: str, device: torch.device) -> torch.Tensor:
        """The int64 index tensor of ``side`` on ``device`` (cached)."""
        key = (side, str(device))
        if key not in self._tensors:
            values = self.src if side == "src" else self.dst
            t = torch.from_numpy(values)
            self._tensors[key] = t if device.type == "cpu" else t.to(device)
        return self._tensors[key]


class RowPlan:
    """What one copy moves, worked out once for every buffer and layer (numpy, on the
    host): the rows to copy (skips and out-of-range rows dropped) and, where ``page_tokens
    > 1``, the whole pages among them: pages that are the aligned run ``p * page_tokens ..``
    on both sides, which can move as units larger than a row. Built by :func:`plan_rows`
    (from row lists) or :func:`plan_whole_pages` (from pages, when all are whole)."""

    def __init__(self, page_tokens: int, errors: int, pages, all_whole: bool, rows, rest):
        self.page_tokens = page_tokens
        self.errors = errors  # out-of-range rows, skipped
        self._pages = pages  # (src, dst) page numbers of the whole pages, or None
        self.all_whole = all_whole
        self._make_rows, self._make_rest = rows, rest  # () -> Part, on first use
        self._rows: Part | None = None
        self._rest: Part | None = None
        self._units: dict[int, Part] = {}

    @property
    def some_whole(self) -> bool:
        return self._pages is not None

    @property
    def pages(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(src, dst)`` page numbers of the whole pages (int64), or None."""
        return self._pages

    @property
    def rows(self) -> Part:
        """Every row to copy."""
        if self._rows is None:
            self._rows = self._make_rows()
        return self._rows

    @property
    def rest(self) -> Part:
        """The rows to copy that are not in a whole page."""
        if self._rest is None:
            self._rest = self._make_rest()
        return self._rest

    def units(self, unit_tokens: int) -> Part:
        """The whole pages in units of ``unit_tokens`` rows (a divisor of ``page_tokens``):
        unit ``u`` is rows ``u * unit_tokens ..``."""
        part = self._units.get(unit_tokens)
        if part is None:
            per_page = self.page_tokens // unit_tokens
            pages = self._units.get(self.page_tokens)
            if pages is None:
                pages = self._units[self.page_tokens] = Part(*self._pages)
            if per_page == 1:
                part = pages
            else:  # a side is a run of units where its pages are a run
                runs = {side: None if (r := pages.run(side)) is None else r * per_page
                        for side in ("src", "dst")}
                part = Part(*((p[:, None] * per_page + _steps(per_page)).reshape(-1)
                              for p in self._pages), runs=runs)
            self._units[unit_tokens] = part
        return part


def plan_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor, src_limit: int,
              dst_limit: int, page_tokens: int = 1) -> RowPlan:
    """The :class:`RowPlan` of copying ``src_rows[i] -> dst_rows[i]`` between pools of
    ``src_limit`` and ``dst_limit`` rows; ``page_tokens > 1`` looks for whole pages."""
    s, d = _as_numpy(src_rows), _as_numpy(dst_rows)
    if not s.size or (int(min(s.min(), d.min())) >= 0 and int(s.max()) < src_limit
                      and int(d.max()) < dst_limit):
        keep, errors = None, 0  # the usual case: nothing to drop
    else:
        bad = (s < -1) | (s >= src_limit) | (d < -1) | (d >= dst_limit)
        errors = int(bad.sum())
        keep = (s >= 0) & (d >= 0) & ~bad

    def rows() -> Part:
        return Part(s, d) if keep is None else Part(s[keep], d[keep])

    whole = None
    if page_tokens > 1 and s.size and s.size % page_tokens == 0:
        whole = _whole_pages(s, page_tokens, src_limit) & _whole_pages(d, page_tokens, dst_limit)
        if keep is not None:
            whole &= keep.reshape(-1, page_tokens).all(axis=1)
        if not whole.any():
            whole = None
    if whole is None:
        return RowPlan(page_tokens, errors, None, False, rows, rows)

    def rest() -> Part:
        left = np.repeat(~whole, page_tokens)
        if keep is not None:
            left &= keep
        return Part(s[left], d[left])

    all_whole = bool(whole.all())
    pages = tuple((x[::page_tokens] if all_whole else x[::page_tokens][whole]) // page_tokens
                  for x in (s, d))
    return RowPlan(page_tokens, errors, pages, all_whole, rows, rest)


def plan_whole_pages(kv_pages: torch.Tensor, slots: torch.Tensor, kv_rows: int,
                     num_slots: int, *, kv_is_src: bool) -> RowPlan | None:
    """The :class:`RowPlan` of a gather (``kv_is_src``) or scatter between KV token rows
    ``kv_pages`` (``[n, page_tokens]``, on the CPU) and staging ``slots`` (``[n]``), when
    every page is whole: in range, no ``-1``, and each KV page the aligned run ``p *
    page_tokens ..``. None otherwise (:func:`plan_rows` handles every case). A few numpy
    passes over the pages and no row lists: the usual case of a paged KV cache."""
    n, page_tokens = kv_pages.shape
    if n == 0 or kv_pages.device.type != "cpu" or slots.device.type != "cpu":
        return None
    kv = kv_pages.numpy()
    largest_page = (kv_rows - page_tokens) // page_tokens
    if kv.size <= SMALL_ROWS:  # a few pages: Python's lists cost less than numpy's calls
        found = _small_whole_pages(kv.tolist(), slots.tolist(), page_tokens, largest_page,
                                   num_slots)
        if found is None:
            return None
        pages, st = (np.array(x, dtype=np.int64) for x in found)
    else:
        pages = (kv[:, 0] // page_tokens).astype(np.int64, copy=False)  # a new array
        if page_tokens > 1 and not bool((kv == (pages * page_tokens)[:, None]
                                         + _steps(page_tokens)).all()):
            return None  # some page is not an aligned run (or holds -1)
        st = np.ascontiguousarray(slots.numpy(), dtype=np.int64)
        # Pages are aligned runs now: their numbers bound every row. A negative number is a
        # huge one unsigned, so one max per side checks both ends of the range.
        if int(pages.view(np.uint64).max()) > largest_page \
                or int(st.view(np.uint64).max()) >= num_slots:
            return None

    def rows() -> Part:
        kv_flat = pages if page_tokens == 1 else np.asarray(kv.reshape(-1), dtype=np.int64)
        st_flat = st if page_tokens == 1 else (st[:, None] * page_tokens
                                               + _steps(page_tokens)).reshape(-1)
        return Part(kv_flat, st_flat) if kv_is_src else Part(st_flat, kv_flat)

    return RowPlan(page_tokens, 0, (pages, st) if kv_is_src else (st, pages), True, rows, rows)


def _small_whole_pages(rows: list[list[int]], slots: list[int], page_tokens: int,
                       largest_page: int, num_slots: int) -> tuple[list, list] | None:
    """:func:`plan_whole_pages`'s test on a few pages, in Python: the page numbers and slots
    where every page is an aligned run in range and every slot in range, else None."""
    pages = []
    for row in rows:
        first = row[0]
        page, offset = divmod(first, page_tokens)
        if offset or not 0 <= page <= largest_page or (
                page_tokens > 1 and row != list(range(first, first + page_tokens))):
            return None
        pages.append(page)
    if not all(0 <= s < num_slots for s in slots):
        return None
    return pages, slots


@functools.lru_cache(maxsize=64)
def _steps(count: int) -> np.ndarray:
    """``0 .. count - 1`` (int64, read-only: shared by every call)."""
    steps = np.arange(count, dtype=np.int64)
    steps.flags.writeable = False
    return steps


@functools.lru_cache(maxsize=256)
def unit_tokens(page_tokens: int, row_bytes: int) -> int:
    """The rows per unit the torch backend moves whole pages in: the largest divisor of
    ``page_tokens`` whose unit fits :data:`UNIT_BYTES` (1: row by row)."""
    fits = [u for u in range(1, page_tokens + 1)
            if page_tokens % u == 0 and u * row_bytes <= UNIT_BYTES]
    return max(fits, default=1)


def _whole_pages(rows: np.ndarray, page_tokens: int, limit: int) -> np.ndarray:
    """Per page of ``rows`` (viewed ``[n, page_tokens]``): whether it is the aligned run
    ``p * page_tokens .. p * page_tokens + page_tokens - 1`` of a pool of ``limit`` rows."""
    first = rows[::page_tokens]
    ok = (first >= 0) & (first % page_tokens == 0) & (first + page_tokens <= limit)
    if _run_start(rows) is not None:  # one run (e.g. fresh staging slots): no more to check
        return ok
    steps = np.empty(rows.size, dtype=bool)
    steps[:-1] = rows[1:] - rows[:-1] == 1
    steps[-1] = True
    return ok & steps.reshape(-1, page_tokens)[:, :-1].all(axis=1)
