"""The one abstraction both sides of every copy share: a row pool.

For each named buffer and each layer, a byte view ``[num_rows, row_bytes]``
(row ``r`` of layer ``l`` starts at ``base[l] + r * pitch``). A KV cache is a
row pool whose rows are token slots; a layer-first staging buffer is a row
pool whose rows are ``slot * page_tokens + t``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch

from kvmove.kernels.alignment import pow2_alignment
from kvmove.memory.device_constants import device_constant

RUN_VIEWS_KEPT = 32  # per buffer: runs whose per-layer views are kept
# Element types of element-wise copies, widest first. complex128 is the only 16-byte type
# torch has; copies move its bits untouched (no arithmetic), and index_copy_ runs 15-40%
# faster in 16-byte elements than in 8-byte ones (656 to 4096-byte rows, measured).
WIDE_TYPES = (torch.complex128, torch.int64, torch.int32, torch.int16)


@dataclass(frozen=True)
class BufferRows:
    """The rows of one buffer: one uint8 view ``[num_rows, row_bytes]`` per layer."""

    name: str
    layers: tuple[torch.Tensor, ...]  # uint8 [num_rows, row_bytes], stride (pitch, 1)
    row_bytes: int
    pitch: int  # bytes from one row to the next, the same in every layer
    num_rows: int
    device: torch.device
    dtype: torch.dtype  # the element type the engine sees (uint8 for staging)
    row_shape: tuple[int, ...]  # the engine's shape of one row
    # Addresses the device uses for each layer's base (UVA addresses of pinned host memory).
    device_addresses: tuple[int, ...]
    _tables: dict = field(default_factory=dict, compare=False, repr=False)
    _runs: dict = field(default_factory=dict, compare=False, repr=False)
    _runs_lock: threading.Lock = field(default_factory=threading.Lock, compare=False,
                                       repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def dense(self) -> bool:
        """Whether rows follow each other without padding (pitch == row bytes): then a run
        of rows is one contiguous span in each layer."""
        return self.pitch == self.row_bytes

    @functools.cached_property
    def on_host(self) -> bool:
        """Whether the rows live in host memory (the CPU's view of them)."""
        return self.device.type == "cpu"

    @functools.cached_property
    def host_bases(self) -> tuple[int, ...]:
        """The host address of each layer's first row (a buffer in host memory)."""
        if not self.on_host:
            raise ValueError(f"buffer {self.name!r} lives on {self.device}, not on the host")
        return tuple(t.data_ptr() for t in self.layers)

    @functools.cached_property
    def host_extents(self) -> tuple[tuple[int, int], ...]:
        """Per layer, the host addresses ``(first byte, end)`` its rows span (a buffer in
        host memory)."""
        span = (self.num_rows - 1) * self.pitch + self.row_bytes if self.num_rows else 0
        return tuple((base, base + span) for base in self.host_bases)

    def apart_from(self, other: BufferRows) -> bool:
        """Whether no byte of ``other``'s layers lies in a span of this buffer's (two pools
        over the same tensors overlap; host memory; cached, by ``other``'s addresses)."""
        key = ("apart", other.host_extents)
        apart = self._tables.get(key)
        if apart is None:
            spans = sorted([(a, b, 0) for a, b in self.host_extents]
                           + [(a, b, 1) for a, b in other.host_extents])
            reach, apart = [0, 0], True  # the furthest end of each side's spans so far
            for start, end, side in spans:
                if start < reach[1 - side]:
                    apart = False
                    break
                reach[side] = max(reach[side], end)
            self._tables[key] = apart
        return apart

    def address_table(self, layers: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int64 tensor of the device addresses of ``layers``, on ``device`` (cached; made
        without waiting for the caller's streams, readable from any stream)."""
        key = (layers, str(device))
        table = self._tables.get(key)
        if table is None:
            table = device_constant(torch.tensor(
                [self.device_addresses[layer] for layer in layers], dtype=torch.int64), device)
            self._tables[key] = table
        return table

    def widest_type(self, unit: int) -> torch.dtype:
        """The widest element type whose elements tile every unit of ``unit`` rows in every
        layer: the unit's bytes, its pitch and each layer's base address (and offset in its
        storage) are multiples of its size (uint8 when nothing wider fits; cached)."""
        key = ("width", unit)
        dtype = self._tables.get(key)
        if dtype is None:
            size = pow2_alignment(unit * self.row_bytes, unit * self.pitch,
                                  *(t.data_ptr() for t in self.layers),
                                  *(t.storage_offset() for t in self.layers))
            dtype = next((w for w in WIDE_TYPES if w.itemsize <= size), torch.uint8)
            self._tables[key] = dtype
        return dtype

    def unit_views(self, unit: int, dtype: torch.dtype = torch.uint8
                   ) -> tuple[torch.Tensor, ...]:
        """Per layer, the rows in units of ``unit`` rows: ``[num_rows // unit, unit *
        row_bytes]`` bytes (unit ``u`` is rows ``u * unit ..``; a trailing part unit is left
        out), as elements of ``dtype`` (see :meth:`widest_type`). Unit 1 is the rows as they
        are; larger units need rows without padding (cached)."""
        key = ("units", unit, dtype)
        views = self._tables.get(key)
        if views is None:
            if unit == 1:
                views = self.layers
            elif self.pitch != self.row_bytes:
                raise ValueError(f"buffer {self.name!r} has padded rows (pitch {self.pitch} > "
                                 f"{self.row_bytes} bytes): no units of {unit} rows")
            else:
                n = self.num_rows // unit
                views = tuple(t[: n * unit].view(n, unit * self.row_bytes)
                              for t in self.layers)
            if dtype != torch.uint8:
                views = tuple(v.view(dtype) for v in views)
            self._tables[key] = views
        return views

    def unit_arrays(self, unit: int) -> tuple[np.ndarray, ...] | None:
        """Per layer, the byte units of :meth:`unit_views` as numpy arrays on the same host
        memory; None where the rows are not in host memory or a layer's units are not one
        contiguous block (padded rows: numpy would copy a strided source whole) (cached)."""
        key = ("arrays", unit)
        if key in self._tables:
            return self._tables[key]
        arrays = None
        if self.on_host and self.dense:
            arrays = tuple(v.detach().numpy() for v in self.unit_views(unit))
            if not all(a.flags.c_contiguous for a in arrays):
                arrays = None
        self._tables[key] = arrays
        return arrays

    def stacked_units(self, layers: tuple[int, ...], unit: int, dtype: torch.dtype
                      ) -> torch.Tensor | None:
        """The units of ``layers`` (see :meth:`unit_views`) as one 3-D view ``[len(layers),
        units, unit bytes / itemsize]``, where those layers lie evenly spaced, without
        overlap, in one storage (every staging buffer; a cache given as one stacked tensor):
        one torch call then moves every layer, with one parallel region instead of one per
        layer. None otherwise (cached)."""
        key = ("stacked", layers, unit, dtype)
        if key in self._tables:
            return self._tables[key]
        views = self.unit_views(unit, dtype)
        chosen = [views[i] for i in layers]
        stacked = None
        if chosen:
            first = chosen[0]
            offsets = [v.storage_offset() for v in chosen]
            steps = {b - a for a, b in itertools.pairwise(offsets)}
            step = steps.pop() if len(steps) == 1 else (0 if not steps else None)
            extent = first.shape[0] * first.stride(0)
            same = all(v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                       and v.stride() == first.stride() for v in chosen)
            if same and step is not None and (len(chosen) == 1 or step >= extent):
                stacked = first.as_strided((len(chosen), *first.shape),
                                           (max(step, 1), *first.stride()),
                                           first.storage_offset())
        self._tables[key] = stacked
        return stacked

    def stacked_run(self, layers: tuple[int, ...], unit: int, start: int, count: int,
                    dtype: torch.dtype) -> torch.Tensor | None:
        """Units ``start .. start + count - 1`` of :meth:`stacked_units`; None where there is
        no such view. The views made last are kept (the oldest goes first; a hit costs one
        dictionary lookup, no lock): a slot allocator hands out the same runs again and
        again."""
        key = ("stacked", layers, unit, start, count, dtype)
        view = self._runs.get(key)
        if view is not None:
            return view
        stacked = self.stacked_units(layers, unit, dtype)
        if stacked is None:
            return None
        if start < 0 or count < 0 or start + count > stacked.shape[1]:
            raise IndexError(f"buffer {self.name!r}: units {start}..{start + count - 1}"
                             f" of {unit} rows are outside its {stacked.shape[1]}")
        view = stacked[:, start:start + count]
        with self._runs_lock:
            self._runs[key] = view  # now the most recent
            while len(self._runs) > RUN_VIEWS_KEPT:
                del self._runs[next(iter(self._runs))]  # the least recent
        return view

    def run_views(self, unit: int, start: int, count: int, dtype: torch.dtype = torch.uint8
                  ) -> tuple[torch.Tensor, ...]:
        """Per layer, units ``start .. start + count - 1`` of :meth:`unit_views`. The views of
        the runs used last are kept: a slot allocator hands out the same runs again and
        again, and slicing every layer anew costs more than the copy of a small batch."""
        key = (unit, start, count, dtype)
        with self._runs_lock:
            views = self._runs.pop(key, None)
            if views is None:
                units = self.unit_views(unit, dtype)
                if start < 0 or count < 0 or (units and start + count > units[0].shape[0]):
                    raise IndexError(f"buffer {self.name!r}: units {start}..{start + count - 1}"
                                     f" of {unit} rows are outside its {units[0].shape[0]}")
                views = tuple(t[start : start + count] for t in units)
            self._runs[key] = views  # now the most recent
            while len(self._runs) > RUN_VIEWS_KEPT:
                del self._runs[next(iter(self._runs))]  # the least recent
        return views


def shared_wide_type(a: BufferRows, b: BufferRows, unit: int) -> torch.dtype:
    """The widest element type that tiles units of ``unit`` rows on both sides of a copy
    (each side's width is cached with it; nothing is cached under the other side's
    ``id()``, which a later buffer may reuse)."""
    return min(a.widest_type(unit), b.widest_type(unit), key=lambda t: t.itemsize)


class RowPool:
    """A mapping from buffer name to :class:`BufferRows`, in declaration order."""

    def __init__(self, buffers: list[BufferRows], *, kind: str):
        self.buffers = {b.name: b for b in buffers}
        self.kind = kind  # "KVCache" or "StagingBuffer", for messages
        # What two pools must share to copy rows: buffer -> (layers, row bytes).
        self.shape = {b.name: (b.num_layers, b.row_bytes) for b in buffers}
        # buffer -> all its layers (read-only: shared by every call that copies them all)
        self.all_layers = MappingProxyType({b.name: tuple(range(b.num_layers)) for b in buffers})
        gpus = [b.device for b in buffers if b.device.type != "cpu"]
        self.device = gpus[0] if gpus else torch.device("cpu")  # where its memory lives
        # Prepared copies from or to this pool (kvmove.rows.prepared), by their geometry.
        self.prepared: OrderedDict = OrderedDict()

    @property
    def buffer_names(self) -> list[str]:
        return list(self.buffers)

    def geometry(self) -> list[tuple[str, int, int]]:
        """(name, layers, row_bytes) per buffer: what two pools must share to copy rows."""
        return [(name, layers, rb) for name, (layers, rb) in self.shape.items()]


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A uint8 ``[num_rows, row_bytes]`` view of a ``[num_rows, *row_shape]`` tensor whose
    rows are contiguous inside (the row pitch may be larger than the row)."""
    rows = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
    if rows.data_ptr() != t.data_ptr() or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError("rows must be contiguous inside")
    if rows.shape[1] == 0:
        raise ValueError("rows must not be empty")
    return rows.view(torch.uint8)
