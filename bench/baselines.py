"""What kvmove is measured against, on the same workload and bytes:

- ``bulk``: one contiguous copy of the same number of bytes (the ceiling; device-to-host or
  host-to-device on a GPU);
- ``primitive`` (CPU): the plain torch primitive, row by row: per layer one
  ``index_select`` of the token rows into the staging view (gather) / ``index_copy_`` from
  it (scatter);
- ``primitive_units`` (CPU): the primitive calls the torch backend makes, made plainly:
  whole pages move in units of up to 16 KiB (numpy's ``take`` into the staging units and
  indexed assignment from them where the backend copies host units by numpy, else
  ``index_select`` and ``index_copy_``, in 16-byte words where aligned, rows too; one
  ``memmove`` per layer where both sides are one run of units), so the torch backend's own
  cost is its time over this one;
- ``memcpy_page``: one memcpy per page-layer span (``ctypes.memmove`` on the CPU,
  ``cudaMemcpyAsync`` to or from pinned host memory on a GPU);
- ``memcpy_row``: one memcpy per token row per layer, what a naive port does;
- ``cpu_rearrange`` (GPU): a bulk copy of the touched KV to pinned host memory, then a CPU
  gather into the staging layout (scatter: the CPU rearranges into KV order, then one bulk
  copy to the device).

Per-call loops are timed on a prefix of at most ``max_calls`` copies (layer-major order);
their rate is their bytes over their time. Every builder returns ``(function, bytes)``.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from bench.cases import Case
from bench.workload import Workload
from kvmove.memory.row_pool import shared_wide_type
from kvmove.rows.plan import unit_tokens
from kvmove.rows.torch_backend.host_copy import host_arrays, put_units, take_into_run, threads_for
from kvmove.rows.torch_backend.reference import (
    MEMMOVE_MAX_BYTES,
    SERIAL_SELECT_MAX_BYTES,
    stacked_select_max_bytes,
)

Method = tuple[Callable[[], None], int]


def bulk(w: Workload, case: Case) -> Method:
    src, dst = ("kv", "staging") if case.direction == "gather" else ("staging", "kv")
    a, b = w.flat(src, case.nbytes), w.flat(dst, case.nbytes)
    blocking = w.device.type != "cuda"

    def run() -> None:
        b.copy_(a, non_blocking=not blocking)

    return run, case.nbytes


def primitive(w: Workload, case: Case) -> Method:
    """Per layer ``index_select(kv, 0, rows, out=staging)`` / ``kv.index_copy_(0, rows,
    staging)``: one call of the plain torch primitive per layer (CPU)."""
    _, _, rows = w.indices(case.pages)
    n = len(rows)
    kv = [w.kv_layer(layer) for layer in range(case.layers)]
    st = [w.staging_layer(layer)[:n] for layer in range(case.layers)]
    if case.direction == "gather":
        def run() -> None:
            for k, s in zip(kv, st, strict=True):
                torch.index_select(k, 0, rows, out=s)
    else:
        def run() -> None:
            for k, s in zip(kv, st, strict=True):
                k.index_copy_(0, rows, s)
    return run, case.nbytes


def primitive_units(w: Workload, case: Case) -> Method:
    """The primitive calls the torch backend makes, made plainly, on ``[units, unit bytes]``
    views in its widest element type (the units it moves whole pages in; rows where pages
    are one token): a ``memmove`` per layer where both sides are one run of units in host
    memory (or a ``copy_``, larger or on a device); a gather as numpy's copies where the
    backend makes them (:mod:`kvmove.rows.torch_backend.host_copy`); else one call for every
    layer where both sides' layers are one evenly spaced view (an ``index_select`` only
    while the copy is small, as the backend does); else a scatter as numpy's copies where
    the backend makes them; else per layer ``index_select`` / ``index_copy_``."""
    unit = unit_tokens(case.page_tokens, w.row_bytes)
    token_pages, _, _ = w.indices(case.pages)
    per_page = case.page_tokens // unit
    units = ((token_pages[:, 0] // unit)[:, None] + torch.arange(per_page)).reshape(-1)
    n, unit_bytes = len(units), unit * w.row_bytes
    kv = [w.kv_layer(layer).view(-1, unit_bytes) for layer in range(case.layers)]
    st = [w.staging_layer(layer).view(-1, unit_bytes)[:n] for layer in range(case.layers)]
    kv_rows, st_rows = w.kv.row_pool.buffers["kv"], w.staging.row_pool.buffers["kv"]
    wide = shared_wide_type(kv_rows, st_rows, unit)
    first = int(units[0])
    run = torch.equal(units, torch.arange(first, first + n))  # run to run (staging is one)
    if run and w.device.type == "cpu" and n * unit_bytes <= MEMMOVE_MAX_BYTES:
        spans = [(k[first].data_ptr(), s.data_ptr()) for k, s in zip(kv, st, strict=True)]
        size = n * unit_bytes
        pairs = spans if case.direction == "gather" else [(s, k) for k, s in spans]

        def run_memmoves() -> None:
            for src, dst in pairs:
                ctypes.memmove(dst, src, size)

        return run_memmoves, case.nbytes
    threads = threads_for(n * unit_bytes, case.layers)
    arrays = host_arrays(kv_rows, st_rows, unit) if threads else None
    if arrays is not None and case.direction == "gather" and not run:
        # into a run of staging units the backend tries numpy before one stacked
        # index_select (kvmove/rows/torch_backend/reference.py, _copy_part): so does this
        (kv_units, st_units), layers, at = arrays, tuple(range(case.layers)), units.numpy()
        return (lambda: take_into_run(kv_units, st_units, layers, at, 0, threads,
                                      apart=kv_rows.apart_from(st_rows)), case.nbytes)
    stacked = _stacked_calls(kv_rows, st_rows, case, unit, units, wide, first)
    if stacked is not None:
        return stacked, case.nbytes
    if run:
        pairs = [(k[first:first + n].view(wide), s.view(wide)) for k, s in zip(kv, st,
                                                                               strict=True)]
        if case.direction == "gather":
            def run_copies() -> None:
                for k, s in pairs:
                    s.copy_(k)
        else:
            def run_copies() -> None:
                for k, s in pairs:
                    k.copy_(s)
        return run_copies, case.nbytes
    if arrays is not None:  # numpy, as the backend scatters host units of this size
        (kv_units, st_units), layers, at = arrays, tuple(range(case.layers)), units.numpy()
        return (lambda: put_units(st_units, kv_units, layers, None, 0, at, threads,
                                  apart=st_rows.apart_from(kv_rows)), case.nbytes)
    pairs = [(k.view(wide), s.view(wide)) for k, s in zip(kv, st, strict=True)]
    if case.direction == "gather":
        if n * unit_bytes > SERIAL_SELECT_MAX_BYTES:  # in bytes: even chunks over threads
            pairs = list(zip(kv, st, strict=True))

        def run_selects() -> None:
            for k, s in pairs:
                torch.index_select(k, 0, units, out=s)

        return run_selects, case.nbytes

    def run_index_copies() -> None:
        for k, s in pairs:
            k.index_copy_(0, units, s)

    return run_index_copies, case.nbytes


def _stacked_calls(kv_rows, st_rows, case: Case, unit: int, units: torch.Tensor, wide,
                   first: int):
    """The torch backend's one call for every layer, made plainly, where both sides' layers
    are one evenly spaced view (:meth:`BufferRows.stacked_units`) and it makes one (an
    index_select up to :func:`stacked_select_max_bytes`); None elsewhere."""
    layers = tuple(range(case.layers))
    kv3, st3 = kv_rows.stacked_units(layers, unit, wide), st_rows.stacked_units(layers, unit, wide)
    if kv3 is None or st3 is None:
        return None
    n = len(units)
    if torch.equal(units, torch.arange(first, first + n)):  # run to run
        k, st = kv3[:, first:first + n], st3[:, :n]
        return (lambda: st.copy_(k)) if case.direction == "gather" else (lambda: k.copy_(st))
    st = st3[:, :n]
    if case.direction == "gather":
        if case.nbytes > stacked_select_max_bytes():
            return None
        return lambda: torch.index_select(kv3, 1, units, out=st)
    return lambda: kv3.index_copy_(1, units, st)


def _spans(w: Workload, case: Case, per: str, max_calls: int):
    """``(dst, src, size)`` address arrays of the per-page or per-row copies of a case,
    layer-major, at most ``max_calls`` of them."""
    token_pages, slots, rows = w.indices(case.pages)
    rb = w.row_bytes
    kv_base = np.array([w.kv_layer(i).data_ptr() for i in range(case.layers)], dtype=np.int64)
    st = w.staging.row_pool.buffers["kv"]
    st_base = np.array(st.device_addresses[: case.layers], dtype=np.int64)
    if per == "page":
        kv_off = token_pages[:, 0].numpy() * rb  # pages are contiguous runs of KV rows
        st_off = slots.numpy() * w.page_tokens * rb
        size = w.page_tokens * rb
    else:
        kv_off = rows.numpy() * rb
        st_off = np.arange(len(rows), dtype=np.int64) * rb
        size = rb
    per_layer = len(kv_off)
    layers = min(case.layers, -(-max_calls // per_layer))
    kv_addr = (kv_base[:layers, None] + kv_off[None, :]).reshape(-1)[:max_calls]
    st_addr = (st_base[:layers, None] + st_off[None, :]).reshape(-1)[:max_calls]
    dst, src = (st_addr, kv_addr) if case.direction == "gather" else (kv_addr, st_addr)
    return dst.tolist(), src.tolist(), size


def _memcpy_loop(w: Workload, dst: list[int], src: list[int], size: int) -> Callable[[], None]:
    if w.device.type == "cuda":
        from kvmove.memory.cuda_api import memcpy_async as copy

        def run() -> None:
            stream = torch.cuda.current_stream(w.device).cuda_stream
            for d, s in zip(dst, src, strict=True):
                copy(d, s, size, stream)  # cudaMemcpyDefault

        return run
    sizes = [size] * len(dst)

    def run() -> None:  # the tightest Python loop of memmoves
        deque(map(ctypes.memmove, dst, src, sizes), maxlen=0)

    return run


def memcpy_page(w: Workload, case: Case, max_calls: int) -> Method:
    dst, src, size = _spans(w, case, "page", max_calls)
    return _memcpy_loop(w, dst, src, size), len(dst) * size


def memcpy_row(w: Workload, case: Case, max_calls: int) -> Method:
    dst, src, size = _spans(w, case, "row", max_calls)
    return _memcpy_loop(w, dst, src, size), len(dst) * size


def cpu_rearrange(w: Workload, case: Case) -> Method:
    """GPU: the KV rows of the case cross PCIe in bulk, the CPU does the rearranging."""
    _, _, rows = w.indices(case.pages)
    n = len(rows)
    mirror = w.mirror()
    kv = [w.kv_layer(layer)[:n] for layer in range(case.layers)]
    host = [mirror[layer][:n] for layer in range(case.layers)]
    st = [w.staging_layer(layer)[:n] for layer in range(case.layers)]
    if case.direction == "gather":
        def run() -> None:
            for k, h in zip(kv, host, strict=True):
                h.copy_(k, non_blocking=True)
            torch.cuda.current_stream(w.device).synchronize()
            for h, s in zip(host, st, strict=True):
                torch.index_select(h, 0, rows, out=s)
    else:
        inverse = torch.empty_like(rows)
        inverse[rows] = torch.arange(n)  # rows is a permutation of 0..n-1

        def run() -> None:
            for s, h in zip(st, host, strict=True):
                torch.index_select(s, 0, inverse, out=h)
            for h, k in zip(host, kv, strict=True):
                k.copy_(h, non_blocking=True)
    return run, case.nbytes


BASELINES = ("bulk", "primitive", "primitive_units", "memcpy_page", "memcpy_row", "cpu_rearrange")


def build(name: str, w: Workload, case: Case, *, max_calls: int) -> Method | None:
    """The baseline ``name`` for this case, or None where it does not apply here."""
    cuda = w.device.type == "cuda"
    if name == "bulk":
        return bulk(w, case)
    if name == "primitive":
        return None if cuda else primitive(w, case)
    if name == "primitive_units":
        return None if cuda else primitive_units(w, case)
    if name == "memcpy_page":
        return memcpy_page(w, case, max_calls)
    if name == "memcpy_row":
        return memcpy_row(w, case, max_calls)
    if name == "cpu_rearrange":
        return cpu_rearrange(w, case) if cuda else None
    raise ValueError(f"unknown baseline {name!r}")
