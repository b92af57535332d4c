"""``copy_rows``, ``gather`` and ``scatter``: rows between two row pools, all layers of all
buffers (or a layer subset), through the Triton kernel or the torch backend."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from kvmove.cache import KVCache
from kvmove.rows.indices import (
    as_index_tensor,
    check_disjoint,
    check_range,
    check_unique,
    page_rows,
)
from kvmove.rows.launch_config import launch_config, preferred_backend
from kvmove.rows.plan import RowPlan, plan_rows, plan_whole_pages
from kvmove.rows.pool import BufferRows, RowPool
from kvmove.rows.torch_backend import copy_rows_torch
from kvmove.staging import StagingBuffer

BACKENDS = ("auto", "triton", "torch", "two_hop")
Pool = KVCache | StagingBuffer


def _row_pool(value, name: str) -> RowPool:
    if not isinstance(value, (KVCache, StagingBuffer)):
        raise TypeError(
            f"{name} must be a kvmove.KVCache or kvmove.StagingBuffer, got {type(value)}"
        )
    return value.row_pool


def kernel_device(src: RowPool, dst: RowPool) -> torch.device:
    """The device that runs the copy: the GPU when either side lives on one."""
    return src.device if src.device.type != "cpu" else dst.device


def resolve_backend(backend: str, device: torch.device, *, direction: str | None = None,
                    row_bytes: int | None = None, page_tokens: int = 1) -> str:
    """The backend that runs a copy on ``device``. ``"auto"`` is torch without a GPU; on
    CUDA it is the direct Triton kernel, or the two-hop path where the tuner recorded that
    as faster for this shape (when ``direction`` and ``row_bytes`` are given)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        if direction is None or row_bytes is None:
            return "triton"
        return preferred_backend(device, direction, row_bytes, page_tokens)
    return backend


def _check_geometry(src: RowPool, dst: RowPool) -> None:
    if src.shape != dst.shape:
        raise ValueError(
            f"source and destination differ in geometry (buffer: (layers, row bytes)): "
            f"{src.kind} {src.shape} vs {dst.kind} {dst.shape}"
        )


def select_layers(pool: RowPool, layers) -> Mapping[str, Sequence[int]]:
    """For each buffer, the layers to copy: all (``None``), the one layer ``l`` of every buffer
    that has it (an int), or a subset (a sequence of ints)."""
    if layers is None:
        return pool.all_layers
    max_layers = max(b.num_layers for b in pool.buffers.values())
    if isinstance(layers, bool):
        raise TypeError(f"layers must be None, an int or a sequence of ints, got {layers!r}")
    wanted = [layers] if isinstance(layers, int) else layers
    if not isinstance(wanted, Sequence) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in wanted
    ):
        raise TypeError(f"layers must be None, an int or a sequence of ints, got {layers!r}")
    for x in wanted:
        if not 0 <= x < max_layers:
            raise IndexError(f"layers: layer {x} is out of range 0..{max_layers - 1}")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"layers names a layer twice: {list(wanted)}")
    return {n: [x for x in wanted if x < b.num_layers] for n, b in pool.buffers.items()}


def _alignment(src: BufferRows, dst: BufferRows, layers) -> int:
    """The greatest common divisor of both sides' base addresses of ``layers``."""
    return math.gcd(src.base_alignment(tuple(layers)), dst.base_alignment(tuple(layers)))


def _launch_triton(src, dst, layers, s, d, errors, direction, page_tokens, device):
    from kvmove.kernels.copy_rows import copy_rows as launch

    config = launch_config(device, direction, src.row_bytes, page_tokens)
    launch(
        src.address_table(tuple(layers), device),
        dst.address_table(tuple(layers), device),
        s,
        d,
        errors,
        src_limit=src.num_rows,
        dst_limit=dst.num_rows,
        src_pitch=src.pitch,
        dst_pitch=dst.pitch,
        row_bytes=src.row_bytes,
        base_alignment=_alignment(src, dst, layers),
        config=config,
    )


def _error_counter(errors: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The caller's error counter, checked, or a new one."""
    if errors is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    if not (isinstance(errors, torch.Tensor) and errors.dtype == torch.int32
            and errors.numel() == 1 and errors.device == device):
        raise TypeError(f"errors must be an int32 tensor of one element on {device}, "
                        f"got {errors!r:.80}")
    return errors


def _whole_page_plan(kv: KVCache, staging: StagingBuffer, token_pages: torch.Tensor,
                     slots: torch.Tensor, backend: str, device: torch.device, *,
                     gathering: bool) -> RowPlan | None:
    """The torch backend's plan of a gather or scatter on the CPU where every page is whole
    (see :func:`plan_whole_pages`): no row lists, no per-row checks. None otherwise."""
    if device.type != "cpu" or resolve_backend(backend, device) != "torch":
        return None
    return plan_whole_pages(token_pages, slots, kv.num_slots, staging.num_slots,
                            kv_is_src=gathering)


def _copy_planned(src: Pool, dst: Pool, plan: RowPlan, device: torch.device, *, layers,
                  errors: torch.Tensor | None) -> torch.Tensor:
    """Every buffer's copy on the torch backend, by a plan made beforehand."""
    sp, dp = src.row_pool, dst.row_pool
    errors = _error_counter(errors, device)
    chosen = select_layers(sp, layers)
    for name, src_buf in sp.buffers.items():
        if chosen[name]:
            copy_rows_torch(src_buf, dp.buffers[name], chosen[name], None, None, None, plan=plan)
    return errors


def _copy(
    src: Pool,
    src_rows: torch.Tensor,
    dst: Pool,
    dst_rows: torch.Tensor,
    *,
    layers,
    backend: str,
    check: bool,
    errors: torch.Tensor | None,
    page_tokens: int,
    direction: str,
) -> torch.Tensor:
    sp, dp = src.row_pool, dst.row_pool
    device = kernel_device(sp, dp)
    kinds = {  # the backend of each buffer ("auto" may differ by row size)
        name: resolve_backend(backend, device, direction=direction, row_bytes=b.row_bytes,
                              page_tokens=page_tokens)
        for name, b in sp.buffers.items()
    }
    chosen = select_layers(sp, layers)
    errors = _error_counter(errors, device)
    if check:
        limit_s = next(iter(sp.buffers.values())).num_rows
        limit_d = next(iter(dp.buffers.values())).num_rows
        check_range(src_rows, limit_s, "src_rows")
        check_range(dst_rows, limit_d, "dst_rows")
        check_unique(dst_rows, "dst_rows")
    if src_rows.numel() == 0:
        return errors
    host_rows = src_rows, dst_rows  # as given, for the two-hop path's span planning
    if "triton" in kinds.values():  # the kernel reads the indices as dense arrays on its device
        src_rows = src_rows.to(device, non_blocking=True).contiguous()
        dst_rows = dst_rows.to(device, non_blocking=True).contiguous()
    counter = errors  # count bad rows in the first buffer's copy only
    plan = None  # the torch backend's index work, shared by all its buffers
    for name, src_buf in sp.buffers.items():
        if not chosen[name]:
            continue
        dst_buf = dp.buffers[name]
        if kinds[name] == "triton":
            _launch_triton(src_buf, dst_buf, chosen[name], src_rows, dst_rows, counter,
                           direction, page_tokens, device)
        elif kinds[name] == "two_hop":
            from kvmove.rows.two_hop import copy_rows_two_hop

            copy_rows_two_hop(src_buf, dst_buf, chosen[name], *host_rows, counter,
                              direction=direction, page_tokens=page_tokens)
        else:
            if plan is None:
                plan = plan_rows(src_rows, dst_rows, src_buf.num_rows, dst_buf.num_rows,
                                 page_tokens)
            copy_rows_torch(src_buf, dst_buf, chosen[name], src_rows, dst_rows, counter,
                            plan=plan)
        counter = None
    return errors


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

    ``src_rows``, ``dst_rows``: int32/int64 ``[n]``; ``-1`` on either side skips the row.
    With ``check=True`` out-of-range rows, duplicate destinations, length, dtype and geometry
    mismatches raise before anything is written. With ``check=False`` out-of-range rows are
    skipped and counted instead. Returns the int32 ``[1]`` error counter (on the copy's
    device; ``errors`` accumulates into a caller's counter).

    ``src`` and ``dst`` may be the same pool (e.g. moving KV pages inside one cache); then
    ``check=True`` also refuses a row that is both read and written.
    """
    sp, dp = _row_pool(src, "src"), _row_pool(dst, "dst")
    device = kernel_device(sp, dp)
    src_rows = as_index_tensor(src_rows, "src_rows", dim=1, device=device)
    dst_rows = as_index_tensor(dst_rows, "dst_rows", dim=1, device=device)
    if src_rows.numel() != dst_rows.numel():
        raise ValueError(
            f"src_rows has {src_rows.numel()} rows but dst_rows has {dst_rows.numel()}"
        )
    _check_geometry(sp, dp)
    if check and src is dst:
        check_disjoint(src_rows, dst_rows)
    staging = next((p for p in (src, dst) if isinstance(p, StagingBuffer)), None)
    page_tokens = staging.page_tokens if staging is not None else 1
    direction = "gather" if isinstance(dst, StagingBuffer) else "scatter"
    return _copy(
        src, src_rows, dst, dst_rows, layers=layers, backend=backend, check=check,
        errors=errors, page_tokens=page_tokens, direction=direction,
    )


def _page_args(kv, staging, token_pages, slots):
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
    if not isinstance(staging, StagingBuffer):
        raise TypeError(f"staging must be a kvmove.StagingBuffer, got {type(staging).__name__}")
    device = kernel_device(kv.row_pool, staging.row_pool)
    token_pages = as_index_tensor(token_pages, "token_pages", dim=2, device=device)
    slots = as_index_tensor(slots, "slots", dim=1, device=device)
    n, p = token_pages.shape
    if n and p != staging.page_tokens:
        raise ValueError(
            f"token_pages has {p} tokens per page but the staging has page_tokens="
            f"{staging.page_tokens}"
        )
    if slots.numel() != n:
        raise ValueError(f"token_pages has {n} pages but slots has {slots.numel()} entries")
    _check_geometry(kv.row_pool, staging.row_pool)
    return token_pages, slots, device


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
    """Gather KV token rows into layer-first staging pages, all layers of all buffers.

    ``token_pages``: int32/int64 ``[n, page_tokens]`` KV token slots; ``-1`` is padding (that
    staging row is left as it was). ``slots``: ``[n]`` staging slots (``-1`` skips a page).
    Returns the int32 ``[1]`` error counter (see :func:`copy_rows`).
    """
    token_pages, slots, device = _page_args(kv, staging, token_pages, slots)
    plan = _whole_page_plan(kv, staging, token_pages, slots, backend, device, gathering=True)
    if plan is not None:  # every row in range: only the slots' uniqueness is left to check
        if check:
            check_unique(plan.pages[1], "slots")
        return _copy_planned(kv, staging, plan, device, layers=None, errors=errors)
    if check:
        check_range(slots, staging.num_slots, "slots")
        check_unique(slots, "slots")
        check_range(token_pages, kv.num_slots, "token_pages")
    return _copy(
        kv, token_pages.reshape(-1), staging, page_rows(slots, staging.page_tokens),
        layers=None, backend=backend, check=False, errors=errors,
        page_tokens=staging.page_tokens, direction="gather",
    )


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
    token_pages, slots, device = _page_args(kv, staging, token_pages, slots)
    plan = _whole_page_plan(kv, staging, token_pages, slots, backend, device, gathering=False)
    if plan is not None:  # whole pages: unique KV rows iff unique KV pages
        if check:
            check_unique(plan.pages[1], "token_pages", page_tokens=staging.page_tokens)
        return _copy_planned(staging, kv, plan, device, layers=layers, errors=errors)
    if check:
        check_range(slots, staging.num_slots, "slots")
        check_range(token_pages, kv.num_slots, "token_pages")
        check_unique(token_pages, "token_pages")
    return _copy(
        staging, page_rows(slots, staging.page_tokens), kv, token_pages.reshape(-1),
        layers=layers, backend=backend, check=False, errors=errors,
        page_tokens=staging.page_tokens, direction="scatter",
    )
