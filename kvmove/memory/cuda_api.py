"""The CUDA calls kvmove makes outside torch and Triton, in one place, through maintained
bindings (no hand-declared prototypes, no library loaded by name): host memory registration
(``torch.cuda.cudart()``), the device address of mapped host memory (:func:`device_pointer`)
and the copy engine (``cudaMemcpyAsync``, ``cudaMemcpy2DAsync``, ``cuMemcpyBatchAsync`` on
CUDA >= 12.8, from ``cuda-bindings``: the ``cuda12`` / ``cuda13`` extras). Every binding is
imported on first use, so a machine without CUDA imports kvmove; a copy-engine call without
``cuda-bindings`` is a :class:`CudaApiError` naming the extra, and
:func:`copy_engine_problem` says why the copy-engine paths cannot run.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvmove.errors import KVMoveError

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (UVA) addresses
STREAM_PER_THREAD = 2  # cudaStreamPerThread / CU_STREAM_PER_THREAD
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
LOCATION_HOST = 2  # CU_MEM_LOCATION_TYPE_HOST
BATCH_MIN_DRIVER = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8


class CudaApiError(KVMoveError):
    """A CUDA call made by kvmove failed, or the binding it needs is not installed."""


class BatchRefused(CudaApiError):
    """``cuMemcpyBatchAsync`` refused a batch; nothing of that batch was enqueued."""

    def __init__(self, message: str, code: int, fail_index: int | None):
        super().__init__(message)
        self.code = code
        self.fail_index = fail_index


def _extra() -> str:
    return f"kvmove[cuda{_major()}]"


@functools.cache
def _bindings():
    """``(cuda.bindings.runtime, cuda.bindings.driver)``, or None when ``cuda-bindings`` is
    not installed (or does not load)."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError as e:
        log.info("cuda-bindings is not installed (%s): no copy-engine copies; device "
                 "addresses of pinned memory by UVA", e)
        return None
    return runtime, driver


def copy_engine_problem() -> str | None:
    """None where the copy-engine calls can be made here; else why not (the fix named)."""
    if _bindings() is None:
        return (f"the copy engine needs cuda-bindings for CUDA {_major()} (install "
                f"{_extra()}, or cuda-bindings>={_major()},<{int(_major()) + 1})")
    return None


def _major() -> str:
    return (torch.version.cuda or "12").split(".")[0]


def _runtime():
    found = _bindings()
    if found is None:
        raise CudaApiError(copy_engine_problem())
    return found[0]


def _driver():
    """``cuda.bindings.driver``, or None when the package is not installed."""
    found = _bindings()
    return None if found is None else found[1]


def _check(what: str, err) -> None:
    code = int(err)
    if code != 0:
        name = getattr(err, "name", "")
        raise CudaApiError(f"{what} failed: CUDA error {code}" + (f" ({name})" if name else ""))


# -- host memory ------------------------------------------------------------------------------
def host_register(address: int, nbytes: int) -> int:
    """Pin ``nbytes`` at ``address`` (portable, mapped) in torch's runtime; return the address
    a kernel uses for byte 0 (the same address on every UVA system)."""
    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
    _check(f"cudaHostRegister({address:#x}, {nbytes} B)",
           torch.cuda.cudart().cudaHostRegister(address, nbytes, flags))
    try:
        return device_pointer(address)
    except Exception:
        host_unregister(address)
        raise


def host_unregister(address: int) -> None:
    """Undo :func:`host_register` of the range starting at ``address``."""
    _check(f"cudaHostUnregister({address:#x})", torch.cuda.cudart().cudaHostUnregister(address))


def device_pointer(address: int) -> int:
    """The device address of registered, mapped host memory at ``address``: what
    ``cudaHostGetDevicePointer`` answers where ``cuda-bindings`` is installed, else the host
    address itself."""
    # On a 64-bit system with unified addressing (every system CUDA 12 and 13 run on) memory
    # registered with cudaHostRegisterMapped has its host address as device address wherever
    # every device reports cudaDevAttrCanUseHostPointerForRegisteredMem (the CUDA runtime's
    # documentation of cudaHostGetDevicePointer). torch's cudart() does not expose that call,
    # so pinned staging and the direct kernel need torch and Triton only.
    found = _bindings()
    if found is None:
        return address
    err, pointer = found[0].cudaHostGetDevicePointer(address, 0)
    _check(f"cudaHostGetDevicePointer({address:#x})", err)
    return int(pointer)


def device_range(address: int) -> tuple[int, int] | None:
    """``(start, nbytes)`` of the CUDA device allocation holding ``address``, or None: the
    driver's pointer attributes where ``cuda-bindings`` is installed, else the segments of
    torch's caching allocator. For register-time checks only (not cheap)."""
    drv = _driver()
    if drv is not None:
        try:
            attr = drv.CUpointer_attribute
            err, kind = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
            if int(err) != 0 or int(kind) != int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE):
                return None
            err, start = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                                   address)
            err2, size = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, address)
            if int(err) == 0 and int(err2) == 0:
                return int(start), int(size)
        except Exception as e:  # a binding that differs: ask torch instead
            log.debug("cuPointerGetAttribute(%#x) failed: %s", address, e)
    for seg in torch.cuda.memory_snapshot():
        start, size = int(seg.get("address", 0)), int(seg.get("total_size", 0))
        if start <= address < start + size:
            return start, size
    return None


# -- copies -------------------------------------------------------------------------------------
def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    rt = _runtime()
    (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind(MEMCPY_DEFAULT), stream)
    _check(f"cudaMemcpyAsync({dst:#x} <- {src:#x}, {nbytes} B)", err)


def memcpy_2d_async(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                    height: int, stream: int) -> None:
    rt = _runtime()
    (err,) = rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                  rt.cudaMemcpyKind(MEMCPY_DEFAULT), stream)
    _check(f"cudaMemcpy2DAsync({dst:#x} <- {src:#x}, {width} B x {height})", err)


@dataclass(frozen=True)
class _Batch:
    driver: object
    returns_fail_index: bool  # the 12.x binding; 13.x dropped failIdx


@functools.cache
def _batch() -> _Batch | None:
    drv = _driver()
    if drv is None or not hasattr(drv, "cuMemcpyBatchAsync"):
        return None
    try:
        err, version = drv.cuDriverGetVersion()
    except Exception as e:  # no driver library at all
        log.info("cuDriverGetVersion failed (%s); no batched copies", e)
        return None
    if int(err) != 0 or version < BATCH_MIN_DRIVER:
        log.info("the CUDA driver (%s) predates cuMemcpyBatchAsync; no batched copies", version)
        return None
    import cuda.bindings

    major = int(str(cuda.bindings.__version__).split(".")[0])
    return _Batch(drv, returns_fail_index=major < 13)


def has_memcpy_batch() -> bool:
    """Whether ``cuMemcpyBatchAsync`` can be called here (driver >= 12.8, cuda-bindings)."""
    return _batch() is not None


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, *,
                 device: int, src_location: tuple[int, int],
                 dst_location: tuple[int, int]) -> None:
    """One ``cuMemcpyBatchAsync`` of ``len(dsts)`` copies on ``stream`` (not the legacy
    default stream), sources read in stream order; ``*_location`` are ``(LOCATION_*, id)``
    hints for every copy. Raises :class:`BatchRefused` when the driver refuses the batch
    (then none of it was enqueued)."""
    batch = _batch()
    if batch is None:
        raise CudaApiError("cuMemcpyBatchAsync is not available here")
    drv = batch.driver
    (err,) = _runtime().cudaSetDevice(device)  # its primary context, current on this thread
    _check(f"cudaSetDevice({device})", err)
    attrs = drv.CUmemcpyAttributes()
    attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    for field, (kind, ident) in (("srcLocHint", src_location), ("dstLocHint", dst_location)):
        loc = drv.CUmemLocation()
        loc.type = drv.CUmemLocationType(kind)
        loc.id = ident
        setattr(attrs, field, loc)
    ptr = drv.CUdeviceptr
    n = len(dsts)
    out = drv.cuMemcpyBatchAsync([ptr(a) for a in dsts.tolist()],
                                 [ptr(a) for a in srcs.tolist()], sizes.tolist(), n,
                                 [attrs], [0], 1, drv.CUstream(stream))
    code = int(out[0])
    if code != 0:
        fail = int(out[1]) if batch.returns_fail_index and len(out) > 1 else None
        raise BatchRefused(f"cuMemcpyBatchAsync of {n} copies failed: CUDA error {code}"
                           + (f" at copy {fail}" if fail is not None else ""), code, fail)
