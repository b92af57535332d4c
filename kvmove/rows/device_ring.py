"""The ring of the two-hop path: scratch rows beside one KV buffer, ``[L, capacity,
row_bytes]`` on the KV's device, that the kernel fills at HBM speed and the copy engine
drains (or the reverse). One ring per KV buffer, reused call after call.

Its size is ``KVMOVE_RING_BYTES`` (default 256 MiB) over all layers of the buffer; a copy
larger than the ring goes through it in chunks. Uses are serialised: on CUDA a use waits
(on the device) for the previous one, whatever stream either ran on; on the CPU a lock
orders them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import torch

from kvmove.rows.pool import BufferRows

ENV_RING_BYTES = "KVMOVE_RING_BYTES"
DEFAULT_RING_BYTES = 256 << 20


def ring_bytes() -> int:
    value = os.environ.get(ENV_RING_BYTES, "").strip()
    if not value:
        return DEFAULT_RING_BYTES
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{ENV_RING_BYTES} must be a number of bytes, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"{ENV_RING_BYTES} must be positive, got {n}")
    return n


class DeviceRing:
    """``capacity`` rows per layer for every layer of ``like``, on ``like.device``."""

    def __init__(self, like: BufferRows, capacity: int):
        self.capacity = capacity
        self.device = like.device
        layers, rb = like.num_layers, like.row_bytes
        self.tensor = torch.empty((layers, capacity, rb), dtype=torch.uint8, device=like.device)
        views = tuple(self.tensor[i] for i in range(layers))
        self.rows = BufferRows(
            name=like.name,
            layers=views,
            row_bytes=rb,
            pitch=rb,
            num_rows=capacity,
            device=like.device,
            dtype=torch.uint8,
            row_shape=(rb,),
            device_addresses=tuple(v.data_ptr() for v in views),
        )
        self._lock = threading.Lock()
        self._last_use = None  # torch.cuda.Event recorded after the previous use

    @contextlib.contextmanager
    def use(self):
        """Hold the ring for one copy: work enqueued inside runs after the previous use."""
        with self._lock:
            cuda = self.device.type == "cuda"
            if cuda:
                stream = torch.cuda.current_stream(self.device)
                if self._last_use is not None:
                    stream.wait_event(self._last_use)
            yield self
            if cuda:
                event = torch.cuda.Event()
                event.record(stream)
                self._last_use = event


_rings: dict[int, DeviceRing] = {}
_rings_lock = threading.Lock()


def ring_for(buffer: BufferRows) -> DeviceRing:
    """The ring of ``buffer`` (created on first use, dropped with the buffer)."""
    capacity = max(1, ring_bytes() // (buffer.num_layers * buffer.row_bytes))
    key = id(buffer)
    with _rings_lock:
        ring = _rings.get(key)
        if ring is None or ring.capacity != capacity:
            if ring is None:
                weakref.finalize(buffer, _rings.pop, key, None)
            ring = DeviceRing(buffer, capacity)
            _rings[key] = ring
        return ring
