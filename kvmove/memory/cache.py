"""``KVCache``: a description of an engine's KV cache as named buffers of per-layer tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvmove.memory.row_pool import BufferRows, RowPool, byte_rows


def _layers_of(name: str, value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.dim() < 2:
            raise ValueError(
                f"buffer {name!r}: a stacked tensor must be [L, num_slots, ...], "
                f"got shape {tuple(value.shape)}"
            )
        return list(value.unbind(0))
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"buffer {name!r}: expected a sequence of per-layer tensors or one stacked "
            f"tensor, got {type(value).__name__}"
        )
    layers = list(value)
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"buffer {name!r} layer {i}: expected a torch.Tensor, got {type(t)}")
    return layers


def _buffer_rows(name: str, value) -> BufferRows:
    if not isinstance(name, str) or not name:
        raise ValueError(f"buffer names must be non-empty strings, got {name!r}")
    layers = _layers_of(name, value)
    if not layers:
        raise ValueError(f"buffer {name!r} has no layers")
    first = layers[0]
    if first.dim() < 1 or first.shape[0] == 0:
        raise ValueError(f"buffer {name!r}: layers must be [num_slots, ...] with num_slots > 0")
    for i, t in enumerate(layers):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"buffer {name!r} layer {i}: shape/dtype/device {tuple(t.shape)}/{t.dtype}/"
                f"{t.device} differ from layer 0's {tuple(first.shape)}/{first.dtype}/"
                f"{first.device}"
            )
    views = []
    for i, t in enumerate(layers):
        try:
            views.append(byte_rows(t))
        except (RuntimeError, ValueError) as e:
            raise ValueError(
                f"buffer {name!r} layer {i}: rows must be contiguous inside "
                f"(shape {tuple(t.shape)}, stride {t.stride()})"
            ) from e
    pitches = {v.stride(0) for v in views}
    if len(pitches) != 1:
        raise ValueError(f"buffer {name!r}: layers have different row pitches {sorted(pitches)}")
    row_bytes = views[0].shape[1]
    pitch = views[0].stride(0)
    if pitch < row_bytes:
        raise ValueError(f"buffer {name!r}: rows overlap (pitch {pitch} < row {row_bytes} bytes)")
    return BufferRows(
        name=name,
        layers=tuple(views),
        row_bytes=row_bytes,
        pitch=pitch,
        num_rows=views[0].shape[0],
        device=first.device,
        dtype=first.dtype,
        row_shape=tuple(first.shape[1:]),
        device_addresses=tuple(v.data_ptr() for v in views),
    )


class KVCache:
    """An engine's KV cache: named buffers, each a sequence of per-layer tensors
    ``[num_slots, *row_shape]`` (or one stacked tensor ``[L, num_slots, *row_shape]``).

    Buffers may differ in layer count, dtype and row bytes, but share ``num_slots`` and the
    device. A row is one token's bytes of one layer; rows must be contiguous inside (the row
    pitch may be larger than the row). kvmove never copies or re-allocates the tensors.

    >>> kv = KVCache({"kv": [torch.zeros(128, 1, 656, dtype=torch.uint8)] * 2})
    """

    def __init__(self, buffers: Mapping[str, Sequence[torch.Tensor] | torch.Tensor]):
        if not isinstance(buffers, Mapping):
            raise TypeError(f"buffers must be a mapping name -> layers, got {type(buffers)}")
        if not buffers:
            raise ValueError("buffers must name at least one buffer")
        rows = [_buffer_rows(name, value) for name, value in buffers.items()]
        slots = {r.name: r.num_rows for r in rows}
        if len(set(slots.values())) != 1:
            raise ValueError(f"buffers must share num_slots, got {slots}")
        devices = {r.name: r.device for r in rows}
        if len(set(devices.values())) != 1:
            raise ValueError(f"buffers must live on one device, got {devices}")
        self._pool = RowPool(rows, kind="KVCache")
        # Fixed with the tensors; read on every call of a mover (as plain attributes: a
        # property's pass over the buffers is a visible part of a call that returns in µs).
        self._num_slots = rows[0].num_rows
        self._max_layers = max(r.num_layers for r in rows)

    # -- description ---------------------------------------------------------------------
    @property
    def buffer_names(self) -> list[str]:
        return self._pool.buffer_names

    def num_layers(self, name: str) -> int:
        return self._buffer(name).num_layers

    def row_bytes(self, name: str) -> int:
        return self._buffer(name).row_bytes

    def dtype(self, name: str) -> torch.dtype:
        return self._buffer(name).dtype

    def row_shape(self, name: str) -> tuple[int, ...]:
        return self._buffer(name).row_shape

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """The uint8 ``[num_slots, row_bytes]`` byte view of one layer of one buffer."""
        return self._buffer(name).layers[layer]

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def device(self) -> torch.device:
        return next(iter(self._pool.buffers.values())).device

    @property
    def max_layers(self) -> int:
        return self._max_layers

    def geometry(self) -> list[tuple[str, int, int, str, tuple[int, ...]]]:
        """(name, layers, row_bytes, dtype, row_shape) per buffer, in declaration order."""
        return [
            (b.name, b.num_layers, b.row_bytes, str(b.dtype), b.row_shape)
            for b in self._pool.buffers.values()
        ]

    @property
    def row_pool(self) -> RowPool:
        return self._pool

    def _buffer(self, name: str) -> BufferRows:
        try:
            return self._pool.buffers[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r}; buffers are {self.buffer_names}") from None

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}: {layers}x{rb}B {dt}" for n, layers, rb, dt, _ in self.geometry()
        )
        return f"KVCache({parts}; {self.num_slots} slots on {self.device})"

