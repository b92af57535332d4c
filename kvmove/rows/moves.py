"""The public row moves — ``copy_rows``, ``gather`` and ``scatter`` — between two row pools,
all layers of all buffers (or a layer subset). Each validates its arguments once, here,
then runs a :class:`~kvmove.rows.prepared.PreparedCopy` unchecked.

Index tensors on the CPU are validated on the host before anything is written. Index
tensors on the copy's device are never read on the host (that would wait for the device):
out-of-range rows there are skipped by the kernel and counted in the returned error
counter, and duplicate destinations are not detected.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmove.checks import (
    as_index_tensor,
    check_range,
    check_unique,
    host_values,
)
from kvmove.memory.cache import KVCache
from kvmove.memory.row_pool import RowPool
from kvmove.memory.staging import StagingBuffer
from kvmove.rows.error_counters import new_error_counter
from kvmove.rows.host_indices import pair_to_device
from kvmove.rows.plan import SMALL_PLAN_ROWS, RowPlan, plan_few_pages, plan_page_rows
from kvmove.rows.prepared import PreparedCopy, prepared_copy
from kvmove.rows.row_numbers import page_rows

Pool = KVCache | StagingBuffer


def _row_pool(value, name: str) -> RowPool:
    if not isinstance(value, (KVCache, StagingBuffer)):
        raise TypeError(
            f"{name} must be a kvmove.KVCache or kvmove.StagingBuffer, got {type(value)}"
        )
    return value.row_pool


def error_counter(errors: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The caller's error counter, checked, or a new one."""
    if errors is None:
        return new_error_counter(device)
    if not (isinstance(errors, torch.Tensor) and errors.dtype == torch.int32
            and errors.numel() == 1 and errors.device == device):
        raise TypeError(f"errors must be an int32 tensor of one element on {device}, "
                        f"got {errors!r:.80}")
    return errors


class PagePlan:
    """What a gather or scatter of pages copies, worked out once: the row indices on the
    side that runs the copy, the same rows on the host where they came from there (the
    two-hop path reads them there), and the torch backend's plan where it has one. One plan
    serves every layer set of the same two pools (a layer-wise prefetch plans once)."""

    __slots__ = ("dst_rows", "host_rows", "pages", "plan", "src_rows")

    def __init__(self, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                 plan: RowPlan | None = None,
                 host_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 pages: tuple[int, int] = (0, 0)):
        self.src_rows, self.dst_rows, self.plan = src_rows, dst_rows, plan
        self.host_rows = host_rows
        self.pages = pages  # per side: P where it holds slots of P-row pages (else 0)


def plan_pages(prepared: PreparedCopy, token_pages: torch.Tensor, slots: torch.Tensor, *,
               check: bool = False) -> PagePlan:
    """The :class:`PagePlan` of a gather (``prepared.direction == "gather"``: KV -> staging)
    or scatter of pages: ``token_pages`` ``[n, page_tokens]`` KV rows, ``slots`` ``[n]``
    staging slots, ``-1`` skips. ``check=True`` runs the checks of :func:`check_pages`.
    On the CPU with the torch backend the torch plan is made here, once, from the pages
    (:func:`~kvmove.rows.plan.plan_few_pages` / :func:`~kvmove.rows.plan.plan_page_rows`,
    which count what the checks need), and the copy plans nothing more."""
    gathering = prepared.gathering
    kv_rows, num_slots = prepared.kv_rows, prepared.staging_slots
    if prepared.torch_only and prepared.parts and token_pages.is_cpu and slots.is_cpu:
        # One plan, made here, serves every buffer and layer (the copy plans nothing more).
        plan = None
        if token_pages.numel() <= SMALL_PLAN_ROWS:  # a few pages: in lists, for less
            plan = plan_few_pages(token_pages, slots, kv_rows, num_slots, kv_is_src=gathering)
        if plan is None:
            plan = plan_page_rows(token_pages, slots, kv_rows, num_slots, kv_is_src=gathering)
        if check:
            check_planned(plan, token_pages, slots, prepared)
        return PagePlan(token_pages, token_pages, plan)  # the rows come from the plan
    if check:
        check_pages(token_pages, slots, kv_rows, num_slots, gathering=gathering)
    if prepared.direct_only:
        # The kernel reads the pages and the slots as they are (no staging row list made
        # per call): moved to the device once, without waiting for it.
        kv, staged = pair_to_device(token_pages.reshape(-1), slots, prepared.device)
        src, dst = (kv, staged) if gathering else (staged, kv)
        return PagePlan(src, dst, pages=prepared.slot_pages)
    kv, staged = token_pages.reshape(-1), page_rows(slots, prepared.page_tokens)
    host = None
    if kv.device.type == staged.device.type == "cpu":
        host = (kv, staged) if gathering else (staged, kv)
    if prepared.device.type == "cuda" and "triton" in prepared.backends:
        # The kernel reads them on its device: moved once, without waiting for the device.
        kv, staged = pair_to_device(kv, staged, prepared.device)
    if gathering:
        return PagePlan(kv, staged, host_rows=host)
    return PagePlan(staged, kv, host_rows=host)


def run_pages(prepared: PreparedCopy, plan: PagePlan, errors: torch.Tensor | None) -> None:
    """Run a planned gather or scatter (unchecked: out-of-range rows are skipped and counted
    in ``errors``)."""
    prepared.run(plan.src_rows, plan.dst_rows, errors, plan=plan.plan, host_rows=plan.host_rows,
                 pages=plan.pages)


def copy_pages(prepared: PreparedCopy, token_pages: torch.Tensor, slots: torch.Tensor,
               errors: torch.Tensor | None, *, check: bool = False) -> None:
    """:func:`plan_pages` then :func:`run_pages`."""
    run_pages(prepared, plan_pages(prepared, token_pages, slots, check=check), errors)


def copy_rows(
    src: Pool,
    src_rows,
    dst: Pool,
    dst_rows,
    *,
    layers=None,
    backend: str = "auto",
    check: bool = True,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy row ``src_rows[i]`` to row ``dst_rows[i]`` between two row pools (``KVCache`` or
    ``StagingBuffer``; staging rows are numbered ``slot * page_tokens + t``), for every layer
    of every buffer (``layers=None``), layer ``l`` of each buffer that has it (an int), or a
    subset (a sequence of ints).

    ``src_rows``, ``dst_rows``: int32/int64 ``[n]`` on the CPU or the copy's device; ``-1``
    on either side skips the row. With ``check=True`` out-of-range rows (of CPU indices),
    duplicate destinations, length, dtype and geometry mismatches raise before anything is
    written. Otherwise out-of-range rows are skipped and counted instead. Returns the int32
    ``[1]`` error counter (on the copy's device; ``errors`` accumulates into a caller's
    counter). Runs on the current stream of the copy's device.

    ``src`` and ``dst`` may be the same pool (e.g. moving KV pages inside one cache); then
    ``check=True`` also refuses a row that is both read and written.
    """
    sp, dp = _row_pool(src, "src"), _row_pool(dst, "dst")
    staging = next((p for p in (src, dst) if isinstance(p, StagingBuffer)), None)
    prepared = prepared_copy(  # checks the pools' geometry when it is made
        sp, dp, layers, backend=backend,
        direction="gather" if isinstance(dst, StagingBuffer) else "scatter",
        page_tokens=staging.page_tokens if staging is not None else 1)
    device = prepared.device
    src_rows = as_index_tensor(src_rows, "src_rows", dim=1, device=device)
    dst_rows = as_index_tensor(dst_rows, "dst_rows", dim=1, device=device)
    if src_rows.numel() != dst_rows.numel():
        raise ValueError(
            f"src_rows has {src_rows.numel()} rows but dst_rows has {dst_rows.numel()}"
        )
    errors = error_counter(errors, device)
    if check and not (src_rows.is_cuda or dst_rows.is_cuda):
        check_range(src_rows, prepared.src_rows_limit, "src_rows")
        check_range(dst_rows, prepared.dst_rows_limit, "dst_rows")
        check_unique(dst_rows, "dst_rows")
        if src is dst:
            check_disjoint(src_rows, dst_rows)
    prepared.run(src_rows, dst_rows, errors)
    return errors


def check_pools(kv, staging) -> None:
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be a kvmove.StagingBuffer, got {type(staging).__name__}")


def page_indices(prepared: PreparedCopy, token_pages, slots):
    """``token_pages`` ``[n, page_tokens]`` and ``slots`` ``[n]`` of a gather or scatter,
    checked (type, shape, device)."""
    device = prepared.device
    token_pages = as_index_tensor(token_pages, "token_pages", dim=2, device=device)
    slots = as_index_tensor(slots, "slots", dim=1, device=device)
    n, p = token_pages.shape
    if n and p != prepared.page_tokens:
        raise ValueError(
            f"token_pages has {p} tokens per page but the staging has page_tokens="
            f"{prepared.page_tokens}"
        )
    if slots.shape[0] != n:
        raise ValueError(f"token_pages has {n} pages but slots has {slots.numel()} entries")
    return token_pages, slots


def check_pages(token_pages: torch.Tensor, slots: torch.Tensor, kv_slots: int,
                staging_slots: int, *, gathering: bool) -> None:
    """The checks of ``check=True`` on CPU page indices: every KV row and slot in range
    (or ``-1``), and no destination named twice (slots for a gather, KV rows for a
    scatter). Device-resident indices are not checked here (see the module's docstring)."""
    if token_pages.is_cuda or slots.is_cuda:
        return
    check_range(slots, staging_slots, "slots")
    check_range(token_pages, kv_slots, "token_pages")
    if gathering:
        check_unique(slots, "slots")
    else:
        check_unique(token_pages, "token_pages")


def check_planned(plan: RowPlan, token_pages: torch.Tensor, slots: torch.Tensor,
                  prepared: PreparedCopy) -> None:
    """The checks of :func:`check_pages` on CPU pages already planned (:func:`plan_pages`):
    the plan counted the rows out of range, and knows where the destinations are one run
    of pages or rows (then none is named twice)."""
    gathering = prepared.gathering
    if plan.errors:
        check_pages(token_pages, slots, prepared.kv_rows, prepared.staging_slots,
                    gathering=gathering)  # raises, naming the first bad value
    if token_pages.shape[0] < 2 or plan.distinct_dst or (
            plan.all_whole and plan.whole_pages_run("dst") is not None):
        return
    if plan.all_whole:  # the destinations' page numbers: fewer values than rows
        check_unique(plan.whole_pages("dst"), "slots" if gathering else "token_pages",
                     page_tokens=1 if gathering else prepared.page_tokens,
                     limit=prepared.staging_slots if gathering
                     else prepared.kv_rows // prepared.page_tokens,
                     skips=not plan.no_skips)
    elif gathering:  # the plan counted no bad value: every one is -1 or in range
        check_unique(slots, "slots", limit=prepared.staging_slots, skips=not plan.no_skips)
    else:
        check_unique(token_pages, "token_pages", limit=prepared.kv_rows,
                     skips=not plan.no_skips)


def gather(
    kv: KVCache,
    staging: StagingBuffer,
    token_pages,
    slots,
    *,
    backend: str = "auto",
    check: bool = True,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather KV token rows into staging pages, all layers of all buffers.

    ``token_pages``: int32/int64 ``[n, page_tokens]`` KV token slots; ``-1`` is padding (that
    staging row is left as it was). ``slots``: ``[n]`` staging slots (``-1`` skips a page).
    Returns the int32 ``[1]`` error counter (see :func:`copy_rows`).
    """
    check_pools(kv, staging)
    prepared = prepared_copy(kv.row_pool, staging.row_pool, backend=backend,
                             direction="gather", page_tokens=staging.page_tokens)
    token_pages, slots = page_indices(prepared, token_pages, slots)
    errors = error_counter(errors, prepared.device)
    copy_pages(prepared, token_pages, slots, errors, check=check)
    return errors


def scatter(
    staging: StagingBuffer,
    slots,
    kv: KVCache,
    token_pages,
    *,
    layers=None,
    backend: str = "auto",
    check: bool = True,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scatter staging pages back into KV token rows: all layers (``layers=None``) or layer
    ``l`` of every buffer that has it (layer-wise prefetch).

    ``slots``: ``[n]`` staging slots; ``token_pages``: int32/int64 ``[n, page_tokens]`` KV
    token slots, ``-1`` = padding (that KV row is left untouched). Returns the error counter.
    """
    check_pools(kv, staging)
    prepared = prepared_copy(staging.row_pool, kv.row_pool, layers, backend=backend,
                             direction="scatter", page_tokens=staging.page_tokens)
    token_pages, slots = page_indices(prepared, token_pages, slots)
    errors = error_counter(errors, prepared.device)
    copy_pages(prepared, token_pages, slots, errors, check=check)
    return errors


def check_disjoint(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Within one pool, no row is both read and written (``-1`` excepted): the result would
    depend on the order of the copies."""
    a, b = host_values(src_rows), host_values(dst_rows)
    # Sorted and searched, not intersect1d/isin: see kvmove.checks.has_repeats.
    read, written = a[a >= 0], np.sort(b[b >= 0])
    if not (read.size and written.size):
        return
    found = written[np.searchsorted(written, read).clip(max=written.size - 1)]
    shared = read[found == read]
    if shared.size:
        raise ValueError(f"src_rows and dst_rows both name row {int(shared[0])} of the same "
                         "pool: a copy within one pool must not write a row it reads")
