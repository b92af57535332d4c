"""Page-aligned host memory for staging; pinned and device-accessible when CUDA is present.

One anonymous ``mmap`` per allocation: zero-filled, resident from the start (Linux), not
shared with forked children, and on CUDA registered whole with one ``cudaHostRegister``
(portable, mapped; :mod:`kvmove.memory.cuda_api`). :meth:`HostMemory.close` unregisters
(a ``weakref.finalize`` does for one dropped without it, before the pages are unmapped).
Kernels must use :attr:`HostMemory.device_address`, not the bare host pointer. The
registration is behind :class:`Pinning` / :func:`pinning_for`, observable without a GPU.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Protocol

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# Linux: the pages are mapped in when the mapping is made (elsewhere they fault in on first
# touch), so none faults in later, while serving. Pinning populates them too; without it (a
# host-memory KV cache) the first calls that touched fresh staging slots paid for their
# pages (2-vCPU VM: the first get of 32 one-token pages x 61 layers took 1.0 ms, the next
# ones 0.4 ms; populated, 0.48 ms).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Pinning(Protocol):
    """Registers host memory with a device."""

    def register(self, address: int, nbytes: int) -> int:
        """Register ``nbytes`` at ``address``; return the device address of byte 0."""

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the range starting at ``address``."""


class CudaPinning:
    """``cudaHostRegister`` (portable, mapped) / ``cudaHostUnregister``."""

    def register(self, address: int, nbytes: int) -> int:
        from kvmove.memory import cuda_api

        return cuda_api.host_register(address, nbytes)

    def unregister(self, address: int) -> None:
        from kvmove.memory import cuda_api

        cuda_api.host_unregister(address)


def pinning_for(device: torch.device) -> Pinning | None:
    """How host memory that kernels on ``device`` reach is registered (None: not at all)."""
    return CudaPinning() if device.type == "cuda" else None


def _unpin_at_collection(pinning: Pinning, address: int, mapping: mmap.mmap) -> None:
    # ``mapping`` is passed only to keep the pages mapped until the unregister has run.
    try:
        pinning.unregister(address)
    except Exception as e:  # the runtime may be gone at interpreter exit
        log.warning("unregistering host memory at %#x failed: %s", address, e)


class HostMemory:
    """``nbytes`` of page-aligned host memory as a uint8 tensor; registered with ``pin``
    (a :class:`Pinning`; ``True`` means CUDA's, ``False``/``None`` none)."""

    def __init__(self, nbytes: int, *, pin: bool | Pinning | None):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.nbytes = nbytes
        # One registration per allocation, the way engines pin their host KV pools: no copy
        # or store span inside it crosses a registration boundary (a range registered
        # piecewise is not one pinned range to the copy engine). One spare page after its
        # bytes: two allocations are never adjacent, so no merged span runs into the next.
        mapped = -(-nbytes // PAGE) * PAGE + PAGE
        self._map = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                              | _POPULATE)
        # A child of fork (the embedded Mooncake master is started by fork + exec) gets no
        # copy-on-write view of pinned pages: a write by the parent never moves a page away
        # from the device's mapping, and a fork does not copy gigabytes of page tables.
        dontfork = getattr(mmap, "MADV_DONTFORK", None)
        if dontfork is not None:
            self._map.madvise(dontfork)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
        self.address = self.tensor.data_ptr()
        self._device_address = self.address
        self._pinning: Pinning | None = CudaPinning() if pin is True else (pin or None)
        self._finalizer: weakref.finalize | None = None
        if self._pinning is not None:
            self._device_address = self._pinning.register(self.address, nbytes)
            self._finalizer = weakref.finalize(self, _unpin_at_collection, self._pinning,
                                               self.address, self._map)

    @property
    def pinned(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    @property
    def device_address(self) -> int:
        """The address a kernel uses for byte 0 of this memory."""
        return self._device_address

    @property
    def registrations(self) -> list[tuple[int, int]]:
        """The ``(address, nbytes)`` ranges registered now (empty when not pinned)."""
        return [(self.address, self.nbytes)] if self.pinned else []

    def close(self) -> None:
        """Unregister the memory (idempotent). The mapping itself lives as long as tensors
        viewing it."""
        if self._finalizer is not None and self._finalizer.detach() is not None:
            self._device_address = self.address
            self._pinning.unregister(self.address)
