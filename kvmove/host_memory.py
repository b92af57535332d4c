"""Page-aligned host memory for staging; pinned and device-accessible when CUDA is present.

One anonymous ``mmap`` per allocation gives page-aligned, zero-filled memory. On CUDA the
range is registered with ``cudaHostRegister`` in chunks (large single pinnings fail on real
systems), with the *mapped* flag, and the device-side address of each chunk is obtained
with ``cudaHostGetDevicePointer``. Kernels must use :attr:`HostMemory.device_address`
(not the bare host pointer) to write into it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
REGISTER_CHUNK = 1 << 30  # bytes pinned per cudaHostRegister call
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch already loaded, for the calls torch does not expose."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("CUDA is available but libcudart could not be loaded")


class HostMemory:
    """``nbytes`` of page-aligned host memory as a uint8 tensor; pinned on CUDA."""

    def __init__(self, nbytes: int, *, pin: bool):
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self._registered: list[int] = []
        self.pinned = False
        self._device_offset = 0  # device address - host address (0 under UVA)
        if pin:
            self._pin()

    @property
    def device_address(self) -> int:
        """The address a CUDA kernel uses for byte 0 of this memory."""
        return self.address + self._device_offset

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        try:
            for start in range(0, self.nbytes, REGISTER_CHUNK):
                size = min(REGISTER_CHUNK, self.nbytes - start)
                err = cudart.cudaHostRegister(self.address + start, size, flags)
                if int(err) != 0:
                    raise RuntimeError(
                        f"cudaHostRegister of {size} bytes at offset {start} failed: {err}"
                    )
                self._registered.append(self.address + start)
        except Exception:
            self._unpin()
            raise
        self.pinned = True
        offsets = {self._device_pointer(a) - a for a in self._registered}
        if len(offsets) != 1:
            self._unpin()
            raise RuntimeError("registered chunks have different device offsets; UVA is required")
        self._device_offset = offsets.pop()

    def _device_pointer(self, host: int) -> int:
        dev = ctypes.c_void_p()
        err = _cudart().cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(host), 0)
        if err != 0:
            raise RuntimeError(f"cudaHostGetDevicePointer failed with error {err}")
        return int(dev.value or 0)

    def _unpin(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered.clear()
        self.pinned = False

    def close(self) -> None:
        """Unpin the memory. The mapping itself lives as long as tensors viewing it."""
        self._unpin()
