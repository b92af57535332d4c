"""Copy-engine span copies: many ``(dst, src, nbytes)`` byte spans enqueued in one go.

On CUDA the spans go to the copy engines on the current stream of the given device: one
``cuMemcpyBatchAsync`` call per batch where the driver has it (CUDA >= 12.8), else one
``cudaMemcpyAsync`` per span. A grid of spans (:func:`copy_span_grid`: the same spans
repeated at a fixed pitch, e.g. once per layer) is one batch too, or without the batched
call one ``cudaMemcpy2DAsync`` per span, covering every repeat.

The batched call refuses the legacy default stream (torch's default): there it goes to the
per-thread default stream instead, which the legacy stream orders against in both
directions, so the copies still run after the work before them and before the work after
them. Addresses are the ones the device uses (UVA addresses of pinned host memory); the
direction of each copy follows from them (``cudaMemcpyDefault``). On the CPU each span is a
``memmove``. Spans of one call must not overlap.

``KVMOVE_COPY_BATCH=0`` turns the batched call off (per-span and 2-D copies only).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np
import torch

log = logging.getLogger(__name__)

ENV_BATCH = "KVMOVE_COPY_BATCH"
MAX_BATCH = 8192  # spans per cuMemcpyBatchAsync call
MAX_2D_PITCH = (1 << 31) - 1  # cudaDevAttrMaxPitch on current GPUs: wider pitches go span by span

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_LOCATION_HOST = 2  # CU_MEM_LOCATION_TYPE_HOST
_STREAM_PER_THREAD = 2  # CU_STREAM_PER_THREAD


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (CUDA 12.8 and 13)."""

    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


def _load(names: tuple[str, ...]) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError(f"none of {names} could be loaded")


def _batch_entry(libcuda: ctypes.CDLL):
    """``(function, takes_fail_idx)`` for ``cuMemcpyBatchAsync`` in the revision that matches
    the driver (13.0 dropped the ``failIdx`` argument), or None when the driver predates it."""
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    wanted = 13000 if version.value >= 13000 else 12080
    fn = ctypes.c_void_p()
    status = ctypes.c_int()
    get = getattr(libcuda, "cuGetProcAddress_v2", None)
    if get is not None:
        get.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int))
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), wanted, 0, ctypes.byref(status))
    else:
        get = libcuda.cuGetProcAddress
        get.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64)
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(fn), wanted, 0)
    if rc != 0 or not fn.value:
        return None
    vp, size = ctypes.c_void_p, ctypes.c_size_t
    if wanted >= 13000:  # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
        proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, size, vp, vp, size, vp)
        return proto(fn.value), False
    # 12.8: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream)
    proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, size, vp, vp, size, vp, vp)
    return proto(fn.value), True


class CudaCopier:
    """The CUDA runtime/driver entry points for span copies, loaded once."""

    def __init__(self):
        cudart = _load(("libcudart.so.13", "libcudart.so.12", "libcudart.so"))
        self.memcpy_async = cudart.cudaMemcpyAsync
        self.memcpy_async.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                      ctypes.c_int, ctypes.c_void_p)
        self.memcpy_async.restype = ctypes.c_int
        self.memcpy_2d_async = cudart.cudaMemcpy2DAsync
        self.memcpy_2d_async.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t,
                                         ctypes.c_int, ctypes.c_void_p)
        self.memcpy_2d_async.restype = ctypes.c_int
        try:
            self._batch = _batch_entry(_load(("libcuda.so.1", "libcuda.so")))
        except (RuntimeError, AttributeError) as e:
            log.info("cuMemcpyBatchAsync unavailable (%s); using per-span copies", e)
            self._batch = None

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def per_span(self, dsts: list, srcs: list, sizes: list, stream: int) -> int:
        copy = self.memcpy_async
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            rc = copy(d, s, n, _MEMCPY_DEFAULT, stream)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpyAsync({d:#x} <- {s:#x}, {n} B) failed: error {rc}")
        return len(dsts)

    def per_column(self, dsts: list, srcs: list, widths: list, dst_pitch: int,
                   src_pitch: int, height: int, stream: int) -> int:
        """One ``cudaMemcpy2DAsync`` per span: ``height`` repeats of ``widths[i]`` bytes,
        ``dst_pitch`` / ``src_pitch`` apart."""
        copy = self.memcpy_2d_async
        for d, s, w in zip(dsts, srcs, widths, strict=True):
            rc = copy(d, dst_pitch, s, src_pitch, w, height, _MEMCPY_DEFAULT, stream)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync({d:#x} <- {s:#x}, {w} B x {height}) "
                                   f"failed: error {rc}")
        return len(dsts)

    def batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
              src_location: tuple[int, int], dst_location: tuple[int, int]) -> bool:
        """One batched call per ``MAX_BATCH`` spans; False (nothing to trust) if refused."""
        fn, takes_fail_idx = self._batch
        attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(*src_location),
                                  _MemLocation(*dst_location), 0)
        zero = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t(0)
        for start in range(0, len(dsts), MAX_BATCH):
            d = np.ascontiguousarray(dsts[start:start + MAX_BATCH], dtype=np.uint64)
            s = np.ascontiguousarray(srcs[start:start + MAX_BATCH], dtype=np.uint64)
            n = np.ascontiguousarray(sizes[start:start + MAX_BATCH], dtype=np.uint64)
            args = [d.ctypes.data, s.ctypes.data, n.ctypes.data, len(d),
                    ctypes.addressof(attrs), ctypes.addressof(zero), 1]
            if takes_fail_idx:
                args.append(ctypes.addressof(fail))
            rc = fn(*args, stream)
            if rc != 0:
                log.warning("cuMemcpyBatchAsync failed (error %d at span %d); falling back to "
                            "per-span cudaMemcpyAsync", rc, start + fail.value)
                self._batch = None
                return False
        return True


_copier: CudaCopier | None = None
_copier_lock = threading.Lock()


def cuda_copier() -> CudaCopier:
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = CudaCopier()
        return _copier


def batch_enabled() -> bool:
    return os.environ.get(ENV_BATCH, "1").strip().lower() not in ("0", "false", "no", "off")


def copy_spans(dsts, srcs, sizes, *, device: torch.device, src_on_device: bool = False,
               dst_on_device: bool = False, batch: bool | None = None) -> int:
    """Copy ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for every ``i``.

    On CUDA (``device``), enqueue on the current stream of ``device``: batched where
    possible (``batch`` None follows ``KVMOVE_COPY_BATCH``; False forces per-span copies);
    ``src_on_device``/``dst_on_device`` are location hints. On the CPU, ``memmove`` each
    span at once. Returns the number of copy calls issued (one per batch or per span).
    """
    dsts = np.asarray(dsts, dtype=np.int64).reshape(-1)
    srcs = np.asarray(srcs, dtype=np.int64).reshape(-1)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if not len(dsts) == len(srcs) == len(sizes):
        raise ValueError(f"span lists differ in length: {len(dsts)}, {len(srcs)}, {len(sizes)}")
    if len(dsts) == 0:
        return 0
    if device.type != "cuda":
        move = ctypes.memmove
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            move(d, s, n)
        return len(dsts)
    copier = cuda_copier()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        use_batch = batch_enabled() if batch is None else batch
        if use_batch and copier.has_batch and len(dsts) > 1:
            here = (_LOCATION_DEVICE, device.index or 0)
            there = (_LOCATION_HOST, 0)
            if copier.batch(dsts, srcs, sizes, stream or _STREAM_PER_THREAD,
                            here if src_on_device else there, here if dst_on_device else there):
                return -(-len(dsts) // MAX_BATCH)
        return copier.per_span(dsts.tolist(), srcs.tolist(), sizes.tolist(), stream)


def copy_span_grid(dsts, srcs, sizes, *, height: int, dst_pitch: int, src_pitch: int,
                   device: torch.device, src_on_device: bool = False,
                   dst_on_device: bool = False, batch: bool | None = None) -> int:
    """Copy ``sizes[i]`` bytes from ``srcs[i] + k * src_pitch`` to ``dsts[i] + k *
    dst_pitch`` for every ``i`` and ``k < height`` (e.g. the same row runs in every layer).
    Pitches must be at least the largest span where ``height > 1``.

    On CUDA: one batched call (as :func:`copy_spans`), else one 2-D copy per span, so the
    host issues ``len(sizes)`` calls, not ``height`` times as many (per-span copies where a
    pitch exceeds :data:`MAX_2D_PITCH`). On the CPU every span is a ``memmove``. Returns
    the number of copy calls issued."""
    dsts = np.asarray(dsts, dtype=np.int64).reshape(-1)
    srcs = np.asarray(srcs, dtype=np.int64).reshape(-1)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if not len(dsts) == len(srcs) == len(sizes):
        raise ValueError(f"span lists differ in length: {len(dsts)}, {len(srcs)}, {len(sizes)}")
    if height < 1:
        raise ValueError(f"height must be at least 1, got {height}")
    if height > 1 and len(sizes) and int(sizes.max()) > min(dst_pitch, src_pitch):
        raise ValueError(f"spans of up to {int(sizes.max())} B overlap their next repeat "
                         f"(pitches {dst_pitch}, {src_pitch})")
    if len(dsts) == 0:
        return 0
    use_batch = batch_enabled() if batch is None else batch
    flat = (device.type != "cuda" or height == 1 or max(dst_pitch, src_pitch) > MAX_2D_PITCH
            or (use_batch and cuda_copier().has_batch))
    if flat:  # every span listed: the batched call (or memmoves on the CPU)
        k = np.arange(height, dtype=np.int64)[:, None]
        return copy_spans((dsts[None, :] + k * dst_pitch).reshape(-1),
                          (srcs[None, :] + k * src_pitch).reshape(-1),
                          np.broadcast_to(sizes, (height, len(sizes))).reshape(-1),
                          device=device, src_on_device=src_on_device,
                          dst_on_device=dst_on_device, batch=batch)
    copier = cuda_copier()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        return copier.per_column(dsts.tolist(), srcs.tolist(), sizes.tolist(), dst_pitch,
                                 src_pitch, height, stream)
