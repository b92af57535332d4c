"""The ring of the two-hop path: scratch rows beside one KV buffer, ``[L, capacity,
row_bytes]`` on the KV's device, that the kernel fills at HBM speed and the copy engine
drains (or the reverse). One ring per KV buffer, ``KVMOVE_RING_BYTES`` (default 256 MiB)
over all its layers and never more rows than the staging holds; a larger copy goes through
it in chunks. The mover allocates its rings when it is built (:func:`prepare_rings`); a ring
is never resized under a copy (replacing it first waits for its last use on the device).
Uses are serialised: on CUDA each waits on the device for the previous one, whatever
stream either ran on; on the CPU a lock orders them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import torch

from kvmove.memory.device_constants import device_constant
from kvmove.memory.row_pool import BufferRows

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
        # Ring row numbers 0 .. capacity - 1 where the copies read them (made once: a call
        # uploads nothing for them). Complete when made, not a kernel on the current stream:
        # the copies read them on other streams, which must not overtake their writing.
        self._numbers = device_constant(torch.arange(capacity, dtype=torch.int64), like.device)
        self._lock = threading.Lock()
        self._last_use = None  # torch.cuda.Event recorded after the previous use

    def row_numbers(self, k: int) -> torch.Tensor:
        """Ring rows ``0 .. k - 1`` (int64, on the ring's device; a view, nothing made)."""
        return self._numbers[:k]

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
                event = torch.cuda.Event(blocking=True)  # wait_idle sleeps on it, never spins
                event.record(stream)
                self._last_use = event
                # so the caching allocator does not hand the ring's memory out again before
                # this stream's work is done
                self.tensor.record_stream(stream)
                self._numbers.record_stream(stream)

    def wait_idle(self) -> None:
        """Block until the device has finished the last use of the ring."""
        with self._lock:
            if self._last_use is not None:
                self._last_use.synchronize()


_rings: dict[int, DeviceRing] = {}
_rings_lock = threading.Lock()


def ring_capacity(buffer: BufferRows, staging_rows: int | None = None) -> int:
    """Rows per layer of ``buffer``'s ring: the ``KVMOVE_RING_BYTES`` budget over all its
    layers, at most ``staging_rows`` (a copy never moves more rows than the staging holds)."""
    capacity = max(1, ring_bytes() // (buffer.num_layers * buffer.row_bytes))
    if staging_rows is not None:
        if staging_rows <= 0:
            raise ValueError(f"staging_rows must be positive, got {staging_rows}")
        capacity = min(capacity, staging_rows)
    return capacity


def ring_for(buffer: BufferRows, capacity: int | None = None) -> DeviceRing:
    """The ring of ``buffer`` (dropped with the buffer).

    With ``capacity`` None: the ring as it was built, or, the first time, a new one of
    :func:`ring_capacity` rows. With a ``capacity``: a ring of exactly that many rows; an
    existing ring of another size is replaced only after its last use has completed on the
    device (a host wait), so no copy in flight loses its memory."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity <= 0):
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    key = id(buffer)
    with _rings_lock:
        ring = _rings.get(key)
        if ring is not None and capacity in (None, ring.capacity):
            return ring
        if ring is None:
            weakref.finalize(buffer, _rings.pop, key, None)
        else:
            ring.wait_idle()
        ring = DeviceRing(buffer, capacity or ring_capacity(buffer))
        _rings[key] = ring
        return ring


def prepare_rings(kv, staging_rows: int) -> dict[str, DeviceRing]:
    """Allocate now the ring of every CUDA buffer of ``kv`` (a :class:`RowPool`, e.g.
    ``KVCache.row_pool``), sized :func:`ring_capacity` for a staging of ``staging_rows``
    rows (``StagingBuffer.num_rows``). Call it when building a mover whose copies may take
    the two-hop path; buffers not on CUDA get no ring here (on first use instead)."""
    return {name: ring_for(buf, ring_capacity(buf, staging_rows))
            for name, buf in kv.buffers.items() if buf.device.type == "cuda"}
