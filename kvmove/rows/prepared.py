"""Prepared copies: everything about copying rows between two row pools for one layer set
that depends on geometry alone — the device, each buffer's backend, its layers, pointer
tables on the device, alignment and launch config — worked out once and cached. A call
then does only what depends on its indices (:meth:`PreparedCopy.run`), unchecked: the
public entry points validate first, once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvmove.memory.row_pool import BufferRows, RowPool
from kvmove.rows.copy_engine import two_hop
from kvmove.rows.host_indices import pair_to_device
from kvmove.rows.launch_config import preferred_backend
from kvmove.rows.plan import RowPlan, plan_rows
from kvmove.rows.row_numbers import page_rows
from kvmove.rows.torch_backend.reference import copy_rows_torch
from kvmove.rows.triton_backend.launcher import KernelArgs, kernel_args, launch

BACKENDS = ("auto", "triton", "torch", "two_hop")
PREPARED_KEPT = 64  # per row pool: prepared copies kept (least recently used dropped)


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


def select_layers(pool: RowPool, layers) -> Mapping[str, tuple[int, ...]]:
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
    return {n: tuple(x for x in wanted if x < b.num_layers) for n, b in pool.buffers.items()}


@dataclass(frozen=True)
class BufferCopy:
    """One buffer's part of a prepared copy."""

    src: BufferRows
    dst: BufferRows
    layers: tuple[int, ...]
    backend: str  # "triton", "torch" or "two_hop"
    # The direct kernel's arguments: backend "triton", and on CUDA "two_hop" too (a call
    # whose rows live on the device runs there: the copy engine needs them on the host).
    kernel: KernelArgs | None = None


class PreparedCopy:
    """Copies of rows from pool ``src`` to pool ``dst`` for one layer set (``None``: all
    layers of all buffers; an int: that layer of each buffer that has it; a sequence), on
    ``backend``, prepared once. ``direction`` ("gather" into staging, "scatter" out of it)
    and ``page_tokens`` pick launch configs."""

    def __init__(self, src: RowPool, dst: RowPool, layers, *, backend: str, direction: str,
                 page_tokens: int):
        self.src, self.dst = src, dst
        self.direction, self.page_tokens = direction, page_tokens
        self.device = kernel_device(src, dst)
        chosen = select_layers(src, layers)
        parts = []
        for name, s in src.buffers.items():
            if not chosen[name]:
                continue
            d = dst.buffers[name]
            kind = resolve_backend(backend, self.device, direction=direction,
                                   row_bytes=s.row_bytes, page_tokens=page_tokens)
            kernel = None
            if kind == "triton" or (kind == "two_hop" and self.device.type == "cuda"):
                kernel = kernel_args(s, d, chosen[name], self.device, direction=direction,
                                     page_tokens=page_tokens)
            parts.append(BufferCopy(s, d, chosen[name], kind, kernel))
        self.parts = tuple(parts)
        self.backends = frozenset(p.backend for p in parts)
        self.torch_only = self.backends <= {"torch"}
        # Only the two-hop path reads the rows on the host (a layer-wise prefetch runs once
        # per group of layers: the others skip looking where the rows are)
        self.reads_host_rows = "two_hop" in self.backends
        self.src_rows_limit = next(iter(src.buffers.values())).num_rows
        self.dst_rows_limit = next(iter(dst.buffers.values())).num_rows
        # A gather or scatter of pages: KV rows and staging slots in range.
        self.gathering = direction == "gather"
        self.kv_rows, staging_rows = ((self.src_rows_limit, self.dst_rows_limit)
                                      if self.gathering
                                      else (self.dst_rows_limit, self.src_rows_limit))
        self.staging_slots = staging_rows // page_tokens
        # Every part is the direct kernel (or there is none): a gather or scatter of pages
        # launches on the page slots as they are (the kernel works out the staging rows).
        self.direct_only = self.backends <= {"triton"}
        # The staging side's page tokens, in the kernel's (src, dst) order, for such launches.
        self.slot_pages = (0, page_tokens) if self.gathering else (page_tokens, 0)

    def run(self, src_rows: torch.Tensor, dst_rows: torch.Tensor,
            errors: torch.Tensor | None, *, plan: RowPlan | None = None,
            host_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
            pages: tuple[int, int] = (0, 0)) -> None:
        """Copy ``src_rows[i] -> dst_rows[i]`` (int32/int64 ``[n]``, on the CPU or the
        copy's device; ``-1`` skips) in every part, without validation: out-of-range rows
        are skipped and added to ``errors`` (int32 ``[1]`` on the copy's device, or None).
        ``plan``: the torch backend's plan of these rows, where the caller made one (then
        its rows are what the torch parts copy). ``host_rows``: the same rows on the host,
        where the caller moved ``src_rows``/``dst_rows`` to the device already (the two-hop
        parts read them there). Runs on the current stream of the copy's device and never
        waits for it: host rows reach the device through a private pinned snapshot, and a
        two-hop part given only device rows runs the direct kernel. ``pages`` (a copy whose
        parts are all the direct kernel, :attr:`direct_only`): per side, ``P`` where that
        side's tensor holds slots of ``P``-row pages instead of rows (see the kernel)."""
        if plan is None and src_rows.numel() == 0:
            return
        if pages != (0, 0):
            if not self.direct_only:
                raise ValueError(f"pages={pages}: page slots need a copy run by the direct "
                                 f"kernel alone, this one runs {sorted(self.backends)}")
            if not self.parts:  # no layer: count the bad rows the slots stand for
                src_rows, dst_rows = (page_rows(t, p) if p else t
                                      for t, p in zip((src_rows, dst_rows), pages, strict=True))
                pages = (0, 0)
        if self.device.type != "cuda" or torch.cuda.current_device() == self.device.index:
            self._run(src_rows, dst_rows, errors, plan, host_rows, pages)
            return
        # On another device: a guard of its own per call (torch.cuda.device keeps the device
        # it replaced on the guard object, so one guard shared by threads restores the wrong
        # device).
        with torch.cuda.device(self.device):
            self._run(src_rows, dst_rows, errors, plan, host_rows, pages)

    def _run(self, src_rows, dst_rows, errors, plan, host_rows, pages) -> None:
        if host_rows is None and self.reads_host_rows and (
                src_rows.device.type == dst_rows.device.type == "cpu"):
            host_rows = (src_rows, dst_rows)
        if not self.parts:  # no layer to copy: the bad rows are counted all the same
            if errors is not None:  # where the rows are: no copy between host and device
                s, d = src_rows, dst_rows
                bad = ((s < -1) | (s >= self.src_rows_limit) | (d < -1)
                       | (d >= self.dst_rows_limit)).sum()
                errors += int(bad) if bad.device.type == "cpu" else bad
            return
        on_device = None
        counter = errors  # count bad rows in the first buffer's copy only
        for part in self.parts:
            direct = part.backend == "triton" or (part.backend == "two_hop"
                                                  and host_rows is None)
            if direct:
                if on_device is None:
                    on_device = tuple(t.contiguous() for t in
                                      pair_to_device(src_rows, dst_rows, self.device))
                launch(part.kernel, *on_device, counter, pages)
            elif part.backend == "two_hop":
                two_hop.copy_rows_two_hop(part.src, part.dst, list(part.layers), *host_rows,
                                          counter, direction=self.direction,
                                          page_tokens=self.page_tokens)
            else:
                if plan is None:
                    plan = plan_rows(src_rows, dst_rows, part.src.num_rows, part.dst.num_rows,
                                     self.page_tokens)
                copy_rows_torch(part.src, part.dst, part.layers, None, None, counter, plan=plan)
            counter = None

    def warm_up(self) -> None:
        """Before serving (CUDA; nothing elsewhere): compile or load every kernel this copy
        may launch, with ``errors=None``, and make its tables and rings, by launches whose
        only row is skipped, on the current stream of the copy's device (where the skip
        rows are made too, so the launches read them in order). Writes nothing."""
        if self.device.type != "cuda":
            return
        with torch.cuda.device(self.device):
            skip = torch.full((max(1, self.page_tokens),), -1, dtype=torch.int64,
                              device=self.device)
            one = skip[:1]
            for part in self.parts:
                if part.kernel is not None:
                    launch(part.kernel, one, one, None)
                    if self.direct_only:  # the launch of a gather or scatter of pages
                        paged = [one if p else skip for p in self.slot_pages]
                        launch(part.kernel, *paged, None, self.slot_pages)
                if part.backend == "two_hop":
                    two_hop.warm_up(part.src, part.dst, part.layers,
                                    direction=self.direction, page_tokens=self.page_tokens)


_cache_lock = threading.Lock()


def _layer_key(layers):
    """The cache key of ``layers`` when it is ``None`` or made of plain ints (an int, or a
    list or tuple of them), else ``None``: a key must never let a value ``select_layers``
    refuses (``True``, ``1.0``, ``np.int64(1)``) reach a copy cached under an equal one."""
    if layers is None or type(layers) is int:
        return layers
    if type(layers) in (list, tuple) and all(type(x) is int for x in layers):
        return tuple(layers)
    return None


def prepared_copy(src: RowPool, dst: RowPool, layers=None, *, backend: str = "auto",
                  direction: str, page_tokens: int) -> PreparedCopy:
    """The :class:`PreparedCopy` of these pools, layers and backend (made on first use,
    then cached). The cache lives with the staging side where there is one (a staging
    buffer already holds its cache alive), else with the destination; it keeps the
    :data:`PREPARED_KEPT` most recently used. Pools of different geometry raise
    ``ValueError`` (checked when the copy is made: a cached one was checked then)."""
    layer_key = _layer_key(layers)
    if layer_key is None and layers is not None:  # not plain ints: checked, then keyed
        select_layers(src, layers)  # raises for what is not a layer
        layer_key = (int(layers) if isinstance(layers, int)
                     else tuple(int(x) for x in layers))
    owner, other = (dst, src) if dst.kind == "StagingBuffer" else (src, dst)
    key = (id(other), owner is src, layer_key, backend, direction, page_tokens)
    cache: OrderedDict = owner.prepared
    hit = cache.get(key)  # a hit takes no lock: each OrderedDict call is atomic under the GIL
    if hit is not None and (hit.dst is other or hit.src is other):
        with contextlib.suppress(KeyError):  # another thread may have dropped it meanwhile
            cache.move_to_end(key)
        return hit
    _check_same_geometry(src.shape, dst.shape, src.kind, dst.kind)
    prepared = PreparedCopy(src, dst, layer_key, backend=backend, direction=direction,
                            page_tokens=page_tokens)
    with _cache_lock:
        cache[key] = prepared
        while len(cache) > PREPARED_KEPT:
            cache.popitem(last=False)
    return prepared


def _check_same_geometry(src_shape: dict, dst_shape: dict, src_kind: str, dst_kind: str
                         ) -> None:
    """Two row pools that rows are copied between name the same buffers with the same
    layers and row bytes (``shape``: buffer -> (layers, row bytes)); else ``ValueError``
    showing both."""
    if src_shape != dst_shape:
        raise ValueError(
            f"source and destination differ in geometry (buffer: (layers, row bytes)): "
            f"{src_kind} {src_shape} vs {dst_kind} {dst_shape}"
        )
