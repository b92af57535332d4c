"""The torch reference backend of the row copy: ``index_select`` / ``index_copy_`` on byte
views, one layer at a time. The correctness oracle in tests, and the fast path on a machine
without a GPU. It honours the kernel's contract: ``-1`` skips, out-of-range rows are
skipped and counted, nothing is written outside a pool.

Speed on the CPU:

- the index work is done once per call, in numpy, for all buffers and layers
  (:mod:`kvmove.rows.plan`): skips and out-of-range rows are dropped, and runs are found;
- whole pages move in units of several rows: where ``page_tokens`` rows are the aligned
  run ``p * page_tokens ..`` on both sides and rows have no padding, the layer is viewed
  as ``[units, unit_tokens * row_bytes]`` (units of up to 16 KiB) and the
  primitive moves units, not rows (fewer index entries, each copy larger);
- a gather or scatter whose pages are all whole (the usual paged KV cache) is planned from
  the pages alone: no row lists are built;
- where both sides are one run of units (a page into a slot, consecutive pages into
  consecutive slots), each layer is one ``copy_``, in the widest element type (so that a
  small copy stays on one thread: waking OpenMP workers costs more than it moves);
- ``index_select`` into a contiguous run of destination rows is a parallel memcpy per row;
  ``index_copy_`` copies element by element, so its units are viewed with the widest element
  type that the unit size, pitch and base addresses allow (8 bytes instead of 1: about 5x
  faster at 656-byte rows; 16 bytes, as complex128, another 15-40%); the per-layer views
  are cached by the row pools.
"""

from __future__ import annotations

import torch

from kvmove.memory.row_pool import BufferRows, shared_wide_type
from kvmove.rows.plan import Part, RowPlan, plan_rows, unit_tokens


def _copy_part(src: BufferRows, dst: BufferRows, layers: tuple[int, ...], unit: int,
               part: Part) -> None:
    """``dst[part.dst[i]] = src[part.src[i]]`` in units of ``unit`` rows, in each layer."""
    m = len(part)
    # Views of both sides in one call, where they share a device and no memory (inside one
    # pool every row is read first: torch refuses overlapping operands).
    direct = src.device == dst.device and src is not dst
    d0 = part.run("dst") if direct else None
    s0 = part.run("src") if direct else None
    wide = shared_wide_type(src, dst, unit)  # fewer elements: small copies stay serial
    # One call for every layer where both sides allow it; one layer (a layer-wise prefetch)
    # goes through the per-layer views, whose cache holds every layer of a run at once.
    stack = len(layers) > 1
    if d0 is not None and s0 is not None:  # run to run: one copy per layer, or one in all
        d3 = dst.stacked_run(layers, unit, d0, m, wide) if stack else None
        s3 = src.stacked_run(layers, unit, s0, m, wide) if d3 is not None else None
        if s3 is not None:
            d3.copy_(s3)
            return
        dst_runs, src_runs = dst.run_views(unit, d0, m, wide), src.run_views(unit, s0, m, wide)
        for i in layers:
            dst_runs[i].copy_(src_runs[i])
        return
    s_idx = part.tensor("src", src.device)
    if d0 is not None:
        s3 = src.stacked_units(layers, unit, wide) if stack else None
        d3 = dst.stacked_units(layers, unit, wide) if s3 is not None else None
        if d3 is not None:  # into a run of every layer: one call
            torch.index_select(s3, 1, s_idx, out=d3[:, d0:d0 + m])
            return
        runs = dst.run_views(unit, d0, m)
        if runs[0].is_contiguous():  # into a run: a memcpy per unit
            views = src.unit_views(unit)
            for i in layers:
                torch.index_select(views[i], 0, s_idx, out=runs[i])
            return
    # Element-wise: in the widest element type both sides allow.
    d_idx = part.tensor("dst", dst.device)
    d3 = dst.stacked_units(layers, unit, wide) if stack else None
    s3 = src.stacked_units(layers, unit, wide) if d3 is not None else None
    if d3 is not None and s3 is not None:  # every layer in one call
        taken = s3[:, s0:s0 + m] if s0 is not None else s3.index_select(1, s_idx)
        d3.index_copy_(1, d_idx, taken.to(dst.device))
        return
    dst_views = dst.unit_views(unit, wide)
    if s0 is not None:  # from a run
        taken = src.run_views(unit, s0, m, wide)
        for i in layers:
            dst_views[i].index_copy_(0, d_idx, taken[i])
        return
    src_views = src.unit_views(unit)
    for i in layers:
        taken = src_views[i].index_select(0, s_idx).to(dst.device)
        dst_views[i].index_copy_(0, d_idx, taken.view(wide))


def copy_rows_torch(
    src: BufferRows,
    dst: BufferRows,
    layers: tuple[int, ...],
    src_rows: torch.Tensor | None,
    dst_rows: torch.Tensor | None,
    errors: torch.Tensor | None,
    *,
    page_tokens: int = 1,
    plan: RowPlan | None = None,
) -> None:
    """Copy ``src_rows[i] -> dst_rows[i]`` for each layer in ``layers`` of one buffer; add
    the number of out-of-range rows to ``errors`` (unless None). ``plan``: the
    :class:`RowPlan` of these rows (then the row tensors are not read), when the caller
    shares one across buffers."""
    layers = tuple(layers)
    if plan is None:
        plan = plan_rows(src_rows, dst_rows, src.num_rows, dst.num_rows, page_tokens)
    if errors is not None and plan.errors:
        errors += plan.errors
    if not layers:
        return
    unit = unit_tokens(plan.page_tokens, src.row_bytes)
    by_page = plan.some_whole and unit > 1 and src.pitch == src.row_bytes == dst.pitch
    if by_page:
        _copy_part(src, dst, layers, unit, plan.units(unit))
        if plan.all_whole:
            return
    rows = plan.rest if by_page else plan.rows
    if len(rows):
        _copy_part(src, dst, layers, 1, rows)
