"""The torch reference backend of the row copy: ``index_select`` / ``index_copy_`` on byte
views (and ``memmove`` of runs in host memory), per layer or every layer of a stacked cache
in one call. The correctness oracle in tests, and the fast path on a machine without a
GPU. It honours the kernel's contract: ``-1`` skips, out-of-range rows are skipped and
counted, nothing is written outside a pool. The index work is done once per call
(:mod:`kvmove.rows.plan`); whole pages move in units of several rows, a run of units in
host memory as one ``memmove`` a layer, larger host copies by
:mod:`kvmove.rows.torch_backend.host_copy`.
"""

from __future__ import annotations

import ctypes

import torch

from kvmove.memory.row_pool import BufferRows, shared_wide_type
from kvmove.rows.plan import Part, RowPlan, plan_rows, unit_tokens
from kvmove.rows.torch_backend.host_copy import (
    host_arrays,
    put_units,
    take_into_run,
    threads_for,
    threads_spin,
)

# A run of units into a run in host memory moves with one memmove per layer up to this many
# bytes per layer: no torch dispatch and no views to make (under a microsecond a layer,
# against microseconds for a view and a copy_), and serial: one copy_ of every layer of a
# stacked cache splits a copy over OpenMP threads past 32768 elements, and on a busy
# machine that region waits for its slowest thread (measured: 61 layers x 21 KiB, 0.1 ms
# by memmoves, 0.4-3.7 ms by one copy_). Larger runs go to torch's copy_.
MEMMOVE_MAX_BYTES = 512 << 10
# An index_select of every layer in one call (a 3-D view, dim 1) saves one call per layer
# but leaves torch's memcpy path for an element-wise one: up to this many bytes in all it
# is faster (measured: 2-16x at 16 KiB-1 MiB, 8 layers), past a few MiB slower (0.7x at
# 20-34 MiB) than one dim-0 index_select per layer.
STACKED_SELECT_MAX_BYTES = 4 << 20
# ... and with OpenMP threads that spin (torch's default: :func:`threads_spin`), up to this
# many: past it, per-layer index_selects hand their rows to threads already awake, where the
# one call (element-wise) stays on one thread (measured back to back, 8 layers: 0.3-0.5x the
# per-layer calls' time at 264-512 KiB, 1.1-1.5x at 1-1.3 MiB).
SPINNING_STACKED_SELECT_MAX_BYTES = 512 << 10

# Up to this many bytes a layer, a per-layer index_select runs in wide elements (one thread);
# past it in bytes (even chunks over the threads).
SERIAL_SELECT_MAX_BYTES = 64 << 10

_memmove = ctypes.memmove  # releases the GIL, as torch's copies do


def stacked_select_max_bytes() -> int:
    """The largest copy (all layers) that one index_select of every layer makes."""
    if threads_spin():
        return min(STACKED_SELECT_MAX_BYTES, SPINNING_STACKED_SELECT_MAX_BYTES)
    return STACKED_SELECT_MAX_BYTES


def _host_run(src: BufferRows, dst: BufferRows, unit: int, part: Part
              ) -> tuple[int, int, int] | None:
    """``(source offset, destination offset, bytes)`` in each layer where the part is one
    run of units into one run, both in host memory without row padding and at most
    :data:`MEMMOVE_MAX_BYTES` a layer: then each layer is one memmove. None otherwise. The
    bounds are checked here, whatever the caller checked: a memmove has no view to stop
    it."""
    s0, d0, m = part.run("src"), part.run("dst"), len(part)
    if (s0 is None or d0 is None or not (src.on_host and dst.on_host and src.dense
                                         and dst.dense)
            or m * unit * src.row_bytes > MEMMOVE_MAX_BYTES):
        return None
    units = src.num_rows // unit, dst.num_rows // unit
    if min(s0, d0, m) < 0 or s0 + m > units[0] or d0 + m > units[1]:
        raise IndexError(f"buffer {src.name!r}: a run of {m} units of {unit} rows at {s0} -> "
                         f"{d0} leaves the pools ({units[0]} and {units[1]} units)")
    unit_bytes = unit * src.row_bytes
    return s0 * unit_bytes, d0 * unit_bytes, m * unit_bytes


def _copy_part(src: BufferRows, dst: BufferRows, layers: tuple[int, ...], unit: int,
               part: Part) -> None:
    """``dst[part.dst[i]] = src[part.src[i]]`` in units of ``unit`` rows, in each layer."""
    key = (id(src), id(dst), unit)  # both buffers live as long as the part
    run = part.moves.get(key, False)
    if run is False:
        run = part.moves[key] = _host_run(src, dst, unit, part)
    if run is not None:
        # A memmove per layer, serial (within one pool too: a memmove reads its whole span
        # before it writes, as the copy's contract asks).
        s_off, d_off, nbytes = run
        src_bases, dst_bases = src.host_bases, dst.host_bases
        for i in layers:
            _memmove(dst_bases[i] + d_off, src_bases[i] + s_off, nbytes)
        return
    m = len(part)
    s0, d0 = part.run("src"), part.run("dst")
    # Views of both sides in one call, where they share a device and no memory (inside one
    # pool every row is read first: torch refuses overlapping operands).
    direct = src is not dst and src.device == dst.device
    stack = len(layers) > 1
    if s0 is not None and d0 is not None:  # run to run, on a device or large
        if direct and stack:  # every layer in one copy, where both sides are one 3-D view
            wide = shared_wide_type(src, dst, unit)
            d3 = dst.stacked_run(layers, unit, d0, m, wide)
            s3 = src.stacked_run(layers, unit, s0, m, wide) if d3 is not None else None
            if s3 is not None:
                d3.copy_(s3)
                return
        if direct:  # one copy per layer, in the widest element type
            wide = shared_wide_type(src, dst, unit)
            dst_runs = dst.run_views(unit, d0, m, wide)
            src_runs = src.run_views(unit, s0, m, wide)
            for i in layers:
                dst_runs[i].copy_(src_runs[i])
            return
    if not direct:
        s0 = d0 = None
    layer_bytes = m * unit * src.row_bytes
    if d0 is not None:
        # numpy first: a memcpy per unit on this thread beats one index_select of every
        # layer (element-wise, over OpenMP threads) wherever numpy is chosen at all
        # (measured on 2 busy vCPUs, 8 layers: 16-64 rows of 132-1152 B, 0.45-0.6x at 16
        # rows, 0.02-0.07x at 32 rows of 656-1152 B).
        threads = threads_for(layer_bytes, len(layers))
        arrays = host_arrays(src, dst, unit) if threads else None
        if arrays is not None:  # numpy: a memcpy per unit
            take_into_run(*arrays, layers, part.src, d0, threads,
                          apart=threads < 2 or src.apart_from(dst))
            return
    wide = shared_wide_type(src, dst, unit)  # fewer elements: small copies stay serial
    if d0 is not None:
        small = layer_bytes * len(layers) <= stacked_select_max_bytes()
        s3 = src.stacked_units(layers, unit, wide) if stack and small else None
        d3 = dst.stacked_units(layers, unit, wide) if s3 is not None else None
        if d3 is not None:  # into a run of every layer: one call
            torch.index_select(s3, 1, part.tensor("src", src.device), out=d3[:, d0:d0 + m])
            return
    if d0 is not None:
        s_idx = part.tensor("src", src.device)
        # Into a run: a memcpy per unit, one call per layer. index_select hands its units
        # to threads in chunks of 32768 elements: in wide elements a small copy stays on
        # one thread (waking OpenMP workers costs more than it moves), in bytes a large one
        # is cut into even 32 KiB chunks.
        serial = layer_bytes <= SERIAL_SELECT_MAX_BYTES
        runs = dst.run_views(unit, d0, m, wide if serial else torch.uint8)
        if runs[0].is_contiguous():
            views = src.unit_views(unit, wide if serial else torch.uint8)
            for i in layers:
                torch.index_select(views[i], 0, s_idx, out=runs[i])
            return
    d3 = dst.stacked_units(layers, unit, wide) if stack else None
    s3 = src.stacked_units(layers, unit, wide) if d3 is not None else None
    threads = threads_for(layer_bytes, len(layers)) if s3 is None else 0
    arrays = host_arrays(src, dst, unit) if threads else None
    if arrays is not None:  # numpy: a memcpy per unit
        put_units(*arrays, layers, None if s0 is not None else part.src, s0, part.dst,
                  threads, apart=threads < 2 or src.apart_from(dst))
        return
    # Element-wise: in the widest element type both sides allow (8 bytes instead of 1:
    # about 5x faster at 656-byte rows; 16 bytes, as complex128, another 15-40%).
    d_idx = part.tensor("dst", dst.device)
    # the source's index tensor only where the copy reads it (a run needs none)
    s_idx = None if s0 is not None else part.tensor("src", src.device)
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
    # Whole pages move in units of several rows where rows have no padding; one-token pages
    # are rows, and the plan's pages are its rows.
    by_page = plan.some_whole and ((unit > 1 and src.dense and dst.dense)
                                   or plan.page_tokens == 1)
    if by_page:
        _copy_part(src, dst, layers, unit, plan.units(unit))
        if plan.all_whole:
            return
    rows = plan.rest if by_page else plan.rows
    if len(rows):
        _copy_part(src, dst, layers, 1, rows)
