"""The plan of one row copy for the torch backend, worked out once per call for every
buffer and layer (and, in a layer-wise copy, every layer): which rows to copy (skips and
out-of-range rows dropped, and counted), which of them form whole pages that can move as
units larger than a row, and where either side is one run of consecutive rows (a memcpy
per unit into a run).

A whole page is ``page_tokens`` rows that are the aligned run ``p * page_tokens ..`` on both
sides. :func:`plan_rows` finds them in row lists (numpy); :func:`plan_whole_pages` builds
the plan of a gather or scatter straight from its pages when every page is whole (a paged
KV cache), without row lists: in numpy, or for a few pages in Python lists, which know
their runs and never become arrays where the copy moves runs (a page into a slot).
:func:`plan_page_rows` (numpy) and :func:`plan_few_pages` (lists) plan any pages, scattered
token slots too, in one pass: what a gather or scatter of pages uses.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvmove.rows.host_indices import to_device

# Up to this many rows, a plan of whole pages is worked out in Python lists: a dozen numpy
# calls cost more than the lists below it (measured: 0.4-0.6x at 4-16 rows, even at 64,
# 2.5-3x at 256).
SMALL_PLAN_ROWS = 64
# Pages move in units of at most this many bytes: torch's CPU index_select leaves its
# memcpy path at 32 KiB slices (2 GB/s instead of 8), and index_copy_ peaks near 16 KiB.
UNIT_BYTES = 16 << 10


def _as_numpy(rows: torch.Tensor) -> np.ndarray:
    """The values of an index tensor as a flat int64 numpy array (a view where possible)."""
    # An index tensor on the CPU is viewed as it is (integers need no detach): fewer calls.
    a = (rows.numpy() if rows.is_cpu else rows.detach().cpu().numpy()).reshape(-1)
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _run_start(rows: np.ndarray) -> int | None:
    """``rows[0]`` if ``rows`` is ``rows[0], rows[0] + 1, ...`` (a run), else None."""
    if rows.size == 0:
        return None
    first = int(rows[0])
    if int(rows[-1]) - first != rows.size - 1:
        return None
    # From first to first + size - 1 in size steps: a run exactly where every step goes up
    # (one comparison, no array of differences made).
    if rows.size > 2 and not bool((rows[1:] > rows[:-1]).all()):
        return None
    return first


class Part:
    """One set of ``src[i] -> dst[i]`` copies in a unit (a row, or several rows). Each side's
    unit numbers are an int64 numpy array, or a list or ``range`` made one on first use (a
    plan of a few pages that copies runs never needs them)."""

    __slots__ = ("_runs", "_sides", "_tensors", "count", "moves")

    def __init__(self, src: np.ndarray | list[int] | range, dst: np.ndarray | list[int] | range,
                 runs: dict[str, int | None] | None = None):
        self._sides = {"src": src, "dst": dst}
        self.count = len(src)
        self._runs: dict[str, int | None] = dict(runs) if runs else {}  # side -> first unit
        self._tensors: dict[tuple[str, torch.device], torch.Tensor] = {}
        # What a backend worked out for moving this part between two buffers, kept for the
        # next layer set (a layer-wise copy runs one plan once per group of layers).
        self.moves: dict = {}

    def __len__(self) -> int:
        return self.count

    def values(self, side: str) -> np.ndarray:
        """The unit numbers of ``side`` ("src" or "dst"), int64."""
        values = self._sides[side]
        if isinstance(values, list):
            values = self._sides[side] = np.array(values, dtype=np.int64)
        elif isinstance(values, range):
            values = self._sides[side] = np.arange(values.start, values.stop, dtype=np.int64)
        return values

    def listed(self, side: str) -> np.ndarray | list[int]:
        """The unit numbers of ``side`` as they are held: a list where the plan was made from
        one and no copy has needed an array yet."""
        values = self._sides[side]
        return list(values) if isinstance(values, range) else values

    @property
    def src(self) -> np.ndarray:
        return self.values("src")

    @property
    def dst(self) -> np.ndarray:
        return self.values("dst")

    def run(self, side: str) -> int | None:
        """The first unit of ``side`` ("src" or "dst") where that side is one run."""
        if side not in self._runs:
            self._runs[side] = _run_start(self.values(side))
        return self._runs[side]

    def tensor(self, side: str, device: torch.device) -> torch.Tensor:
        """The int64 index tensor of ``side`` on ``device`` (cached)."""
        key = (side, device)
        t = self._tensors.get(key)
        if t is None:
            t = to_device(torch.from_numpy(self.values(side)), device)
            self._tensors[key] = t
        return t


class RowPlan:
    """What one copy moves, worked out once for every buffer and layer (on the host): the
    rows to copy (skips and out-of-range rows dropped) and, where ``page_tokens > 1``, the
    whole pages among them: pages that are the aligned run ``p * page_tokens ..`` on both
    sides, which can move as units larger than a row (``pages``: their page numbers, a
    :class:`Part` of units of ``page_tokens`` rows). Built by :func:`plan_rows` (from row
    lists) or :func:`plan_whole_pages` (from pages, when all are whole)."""

    __slots__ = ("_make_rest", "_make_rows", "_rest", "_rows", "_units", "all_whole",
                 "distinct_dst", "errors", "no_skips", "page_tokens")

    def __init__(self, page_tokens: int, errors: int, pages: Part | None, all_whole: bool,
                 rows, rest, *, distinct_dst: bool = False, no_skips: bool = False):
        self.page_tokens = page_tokens
        self.errors = errors  # out-of-range rows, skipped
        self.all_whole = all_whole
        # The planner saw that no destination row is named twice (the destination rows are
        # one run, say): the duplicate check has nothing left to look at.
        self.distinct_dst = distinct_dst
        # The planner saw every row and slot in range: no -1 (skip) on either side.
        self.no_skips = no_skips
        self._make_rows, self._make_rest = rows, rest  # () -> Part, on first use
        self._rows: Part | None = None
        self._rest: Part | None = None
        # unit tokens -> the whole pages in units of that many rows
        self._units: dict[int, Part] = {} if pages is None else {page_tokens: pages}

    @property
    def some_whole(self) -> bool:
        return bool(self._units)

    @property
    def pages(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(src, dst)`` page numbers of the whole pages (int64), or None."""
        part = self._units.get(self.page_tokens)
        return None if part is None else (part.src, part.dst)

    def whole_pages(self, side: str) -> np.ndarray | list[int] | None:
        """The page numbers of ``side`` ("src" or "dst") of the whole pages, as the plan
        holds them (:meth:`Part.listed`), or None."""
        part = self._units.get(self.page_tokens)
        return None if part is None else part.listed(side)

    def whole_pages_run(self, side: str) -> int | None:
        """The first page number of ``side`` where its whole pages are one run (then no
        page is named twice), else None (also where there are no whole pages)."""
        part = self._units.get(self.page_tokens)
        return None if part is None else part.run(side)

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
            pages = self._units[self.page_tokens]
            # a side is a run of units where its pages are a run
            runs = {side: None if (r := pages.run(side)) is None else r * per_page
                    for side in ("src", "dst")}
            part = Part(*((pages.values(side)[:, None] * per_page
                           + _steps(per_page)).reshape(-1) for side in ("src", "dst")),
                        runs=runs)
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
    pages = Part(*((x[::page_tokens] if all_whole else x[::page_tokens][whole]) // page_tokens
                   for x in (s, d)))
    return RowPlan(page_tokens, errors, pages, all_whole, rows, rest)


def plan_whole_pages(kv_pages: torch.Tensor, slots: torch.Tensor, kv_rows: int,
                     num_slots: int, *, kv_is_src: bool) -> RowPlan | None:
    """The :class:`RowPlan` of a gather (``kv_is_src``) or scatter between KV token rows
    ``kv_pages`` (``[n, page_tokens]``, on the CPU) and staging ``slots`` (``[n]``), when
    every page is whole: in range, no ``-1``, and each KV page the aligned run ``p *
    page_tokens ..``. None otherwise (:func:`plan_rows` handles every case). A few numpy
    passes over the pages and no row lists: the usual case of a paged KV cache."""
    n, page_tokens = kv_pages.shape
    if n == 0 or not (kv_pages.is_cpu and slots.is_cpu):
        return None
    largest_page = (kv_rows - page_tokens) // page_tokens
    runs = None
    if n * page_tokens <= SMALL_PLAN_ROWS:  # a few pages: lists cost less than numpy calls
        found = _small_whole_pages(kv_pages.tolist(), slots.tolist(), page_tokens,
                                   largest_page, num_slots)
        if found is None:
            return None
        pages, st, kv_run, st_run = found  # lists: arrays are made where a copy needs them
        runs = {"src": kv_run, "dst": st_run} if kv_is_src else {"src": st_run, "dst": kv_run}
    else:
        kv = kv_pages.numpy()
        # One-token pages are their own numbers: the caller's memory as it is where it is
        # int64 (as the slots are below). New memory per call cost more than its copy:
        # 10 µs more per 256-page gather, back to back.
        pages = (np.ascontiguousarray(kv[:, 0], dtype=np.int64) if page_tokens == 1
                 else (kv[:, 0] // page_tokens).astype(np.int64, copy=False))
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
        kv, st_ = np.asarray(pages, dtype=np.int64), np.asarray(st, dtype=np.int64)
        kv_flat = kv if page_tokens == 1 else (kv[:, None] * page_tokens
                                               + _steps(page_tokens)).reshape(-1)
        st_flat = st_ if page_tokens == 1 else (st_[:, None] * page_tokens
                                                + _steps(page_tokens)).reshape(-1)
        return Part(kv_flat, st_flat) if kv_is_src else Part(st_flat, kv_flat)

    part = Part(pages, st, runs) if kv_is_src else Part(st, pages, runs)
    return RowPlan(page_tokens, 0, part, True, rows, rows)


def _small_whole_pages(rows: list[list[int]], slots: list[int], page_tokens: int,
                       largest_page: int, num_slots: int
                       ) -> tuple[list[int], list[int], int | None, int | None] | None:
    """:func:`plan_whole_pages`'s test on a few pages, in Python: ``(page numbers, slots,
    first page of the pages' run or None, first slot of the slots' run or None)`` where
    every page is an aligned run in range and every slot in range, else None."""
    pages = [row[0] for row in rows] if page_tokens == 1 \
        else _aligned_pages(rows, page_tokens, largest_page)
    if pages is None or min(pages) < 0 or max(pages) > largest_page or min(slots) < 0 \
            or max(slots) >= num_slots:
        return None
    return pages, slots, _list_run(pages), _list_run(slots)


def _list_run(values: list[int]) -> int | None:
    """``values[0]`` where ``values`` is ``values[0], values[0] + 1, ...``, else None."""
    first = values[0]
    if values[-1] - first != len(values) - 1:
        return None
    return first if len(values) < 3 or values == list(range(first, first + len(values))) \
        else None


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


def plan_page_rows(kv_pages: torch.Tensor, slots: torch.Tensor, kv_rows: int,
                   num_slots: int, *, kv_is_src: bool) -> RowPlan:
    """The :class:`RowPlan` of a gather (``kv_is_src``) or scatter of any pages on the CPU:
    KV token rows ``kv_pages`` ``[n, page_tokens]``, staging ``slots`` ``[n]``; ``-1``
    skips, out-of-range rows are dropped and counted, whole pages found. One pass of array
    arithmetic over the pages (no per-side reductions of row lists, no staging row list
    unless a copy needs it): what :func:`plan_rows` of their rows gives, for less."""
    n, page_tokens = kv_pages.shape
    kv, st = _as_numpy(kv_pages), _as_numpy(slots)
    # Slots that are one run (fresh staging slots: the usual case) are in range where its
    # ends are; others by one max: a negative number is a huge one unsigned.
    st_run = _run_start(st)
    slots_ok = (st_run >= 0 and st_run + st.size <= num_slots) if st_run is not None \
        else bool(st.size) and int(st.view(np.uint64).max()) < num_slots
    # Pages of a paged KV cache (the usual case), found without a pass over every row for
    # their range: each page's first row in range and every step inside a page one (then
    # every row is in range: no step can wrap around). The index arrays are cold by the
    # time a large copy plans (the last copy evicted them): every pass over them counts.
    first = kv[::page_tokens] if page_tokens > 1 else kv
    paged = (page_tokens > 1 and slots_ok
             and int(first.view(np.uint64).max()) <= kv_rows - page_tokens
             and _all_aligned_runs(kv, first, page_tokens))
    clean = paged or (slots_ok and bool(kv.size) and int(kv.view(np.uint64).max()) < kv_rows)
    keep, errors = None, 0
    if not clean and kv.size:
        kv_bad = (kv < -1) | (kv >= kv_rows)
        st_bad = np.repeat((st < -1) | (st >= num_slots), page_tokens)
        bad = kv_bad | st_bad
        errors = int(np.count_nonzero(bad))
        keep = (kv >= 0) & np.repeat(st >= 0, page_tokens) & ~bad
    staging_run = st_run if keep is None else None

    def staging_rows() -> np.ndarray:
        return st if page_tokens == 1 else (st[:, None] * page_tokens
                                            + _steps(page_tokens)).reshape(-1)

    def part(kv_side: np.ndarray, st_side: np.ndarray, st_first: int | None = None,
             known: bool = False) -> Part:
        """A part of KV and staging units; ``known``: ``st_first`` is the staging side's
        run (None: it is none), else it is worked out where a copy asks."""
        runs = {("dst" if kv_is_src else "src"): st_first} if known else None
        return Part(kv_side, st_side, runs) if kv_is_src else Part(st_side, kv_side, runs)

    def rows() -> Part:
        if keep is None:
            return part(kv, staging_rows(),
                        None if staging_run is None else staging_run * page_tokens, True)
        return part(kv[keep], staging_rows()[keep])

    # Staging rows are one run where the slots are (and nothing is dropped): distinct.
    distinct = kv_is_src and staging_run is not None
    if page_tokens == 1 or not kv.size:
        return RowPlan(page_tokens, errors, None, False, rows, rows, distinct_dst=distinct,
                       no_skips=clean)
    pages_kv = kv.reshape(n, page_tokens)
    if paged:
        # every page whole (a paged KV cache): no mask of whole pages to make
        pages = part(first // page_tokens, st, staging_run, True)
        return RowPlan(page_tokens, errors, pages, True, rows, rows, distinct_dst=distinct,
                       no_skips=True)
    whole = (pages_kv == first[:, None] + _steps(page_tokens)).all(axis=1)
    whole &= first % page_tokens == 0
    if keep is not None:  # no skip and no bad row in a whole page
        whole &= keep.reshape(n, page_tokens).all(axis=1)
    count = int(np.count_nonzero(whole))
    if count == 0:
        return RowPlan(page_tokens, errors, None, False, rows, rows, distinct_dst=distinct,
                       no_skips=clean)
    if count == n:
        pages = part(first // page_tokens, st, staging_run, True)
        return RowPlan(page_tokens, errors, pages, True, rows, rows, distinct_dst=distinct,
                       no_skips=clean)

    def rest() -> Part:
        left = np.repeat(~whole, page_tokens)
        if keep is not None:
            left &= keep
        return part(kv[left], staging_rows()[left])

    pages = part(first[whole] // page_tokens, st[whole])
    return RowPlan(page_tokens, errors, pages, False, rows, rest, distinct_dst=distinct,
                   no_skips=clean)


def _all_aligned_runs(kv: np.ndarray, first: np.ndarray, page_tokens: int) -> bool:
    """Whether every page of the flat KV rows ``kv`` (``page_tokens > 1`` rows each, the
    first rows ``first`` in range: a step that wraps around int64 then never reads one) is
    the aligned run ``p * page_tokens ..``: each page's first row a multiple of
    ``page_tokens``, and each step inside a page one. Flat
    passes over the rows (a comparison broadcast over ``[n, page_tokens]`` and its
    reduction along rows cost 3-4x as much: numpy's inner loops are one page long)."""
    if bool((first % page_tokens).any()):
        return False
    steps = kv[1:] - kv[:-1]
    steps[page_tokens - 1::page_tokens] = 1  # from one page to the next: any step
    return bool((steps == 1).all())


def plan_few_pages(kv_pages: torch.Tensor, slots: torch.Tensor, kv_rows: int,
                   num_slots: int, *, kv_is_src: bool) -> RowPlan | None:
    """:func:`plan_page_rows` of a few pages (at most :data:`SMALL_PLAN_ROWS` rows): whole
    pages as :func:`plan_whole_pages` finds them, else scattered rows; None where a row or
    slot is ``-1`` or out of range (left to :func:`plan_page_rows`). A dozen numpy calls
    cost more than these lists (from one ``tolist`` a side); a run of staging slots stays a
    ``range``: no staging row list is made where the copy moves into or out of that run."""
    n, page_tokens = kv_pages.shape
    if n == 0:
        return None
    st = slots.tolist()
    st_run = _list_run(st)
    # a run is in range where its ends are (no scan of every slot, twice)
    low, high = (st_run, st[-1]) if st_run is not None else (min(st), max(st))
    if low < 0 or high >= num_slots:
        return None
    held = None  # one-token pages as the copy reads them: the caller's int64 memory, viewed
    if page_tokens == 1:  # one-token pages are their rows: whole where in range
        # below 8 pages the first of each row (a reshape costs more than it saves), else one
        # flat list: of an int64 numpy view, which the copy then reads as it is (the list
        # made an array again cost more than the view: 1.5 us of 24 per 32-page gather)
        if n < 8:
            pages = [r[0] for r in kv_pages.tolist()]
        elif kv_pages.dtype == torch.int64:
            held = kv_pages.numpy().reshape(-1)
            pages = held.tolist()
        else:
            pages = kv_pages.reshape(-1).tolist()
        if min(pages) < 0 or max(pages) >= kv_rows:
            return None
    else:
        rows = kv_pages.tolist()
        pages = _aligned_pages(rows, page_tokens, (kv_rows - page_tokens) // page_tokens)
    if pages is not None:
        kv_run = _list_run(pages)
        runs = {"src": kv_run, "dst": st_run} if kv_is_src else {"src": st_run, "dst": kv_run}
        kv_side = pages if held is None else held  # no array made from the list again
        part = Part(kv_side, st, runs) if kv_is_src else Part(st, kv_side, runs)
        rows_of = (lambda: part) if page_tokens == 1 else _rows_of_pages(pages, st, page_tokens,
                                                                          kv_is_src)
        return RowPlan(page_tokens, 0, part, True, rows_of, rows_of, no_skips=True)
    flat = [r for row in rows for r in row]
    if min(flat) < 0 or max(flat) >= kv_rows:
        return None
    if st_run is None:
        staged: list[int] | range = [s * page_tokens + t for s in st for t in range(page_tokens)]
    else:  # one run of slots is one run of rows: no list of them
        staged = range(st_run * page_tokens, (st_run + n) * page_tokens)
    runs = {"kv": _list_run(flat), "st": None if st_run is None else st_run * page_tokens}
    src, dst = ("kv", "st") if kv_is_src else ("st", "kv")
    sides = {"kv": flat, "st": staged}
    part = Part(sides[src], sides[dst], {"src": runs[src], "dst": runs[dst]})
    return RowPlan(page_tokens, 0, None, False, lambda: part, lambda: part, no_skips=True)


def _aligned_pages(rows: list[list[int]], page_tokens: int, largest_page: int
                   ) -> list[int] | None:
    """The page numbers of ``rows`` (each ``page_tokens`` KV rows) where every one is an
    aligned run ``p * page_tokens ..`` with ``0 <= p <= largest_page``, else None."""
    pages = []
    for row in rows:
        first = row[0]
        if first % page_tokens or row != list(range(first, first + page_tokens)):
            return None  # not aligned, not a run, or padded with -1
        pages.append(first // page_tokens)
    return pages if min(pages) >= 0 and max(pages) <= largest_page else None


def _rows_of_pages(pages: list[int], st: list[int], page_tokens: int, kv_is_src: bool):
    """``() -> Part``: the rows of whole pages ``pages`` and staging slots ``st``."""
    def rows() -> Part:
        kv, st_ = np.asarray(pages, dtype=np.int64), np.asarray(st, dtype=np.int64)
        kv_flat = (kv[:, None] * page_tokens + _steps(page_tokens)).reshape(-1)
        st_flat = (st_[:, None] * page_tokens + _steps(page_tokens)).reshape(-1)
        return Part(kv_flat, st_flat) if kv_is_src else Part(st_flat, kv_flat)
    return rows
