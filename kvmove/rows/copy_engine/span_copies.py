"""Copy-engine span copies: many ``(dst, src, nbytes)`` byte spans enqueued in one go, on
the current stream of the given device: one ``cuMemcpyBatchAsync`` per batch where the
driver has it (CUDA >= 12.8), else one ``cudaMemcpyAsync`` per span; a grid of spans
(:func:`copy_span_grid`, the same spans at a fixed pitch, e.g. per layer) is one batch, or
one ``cudaMemcpy2DAsync`` per span. Addresses are the device's (UVA for pinned host
memory); spans of one call must not overlap. On the CPU each span is a ``memmove``. A batch
the driver refuses is copied span by span, in that call only; ``KVMOVE_COPY_BATCH=0`` turns
the batched call off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np
import torch

from kvmove.memory import cuda_api

log = logging.getLogger(__name__)

ENV_BATCH = "KVMOVE_COPY_BATCH"
MAX_BATCH = 8192  # spans per cuMemcpyBatchAsync call
MAX_2D_PITCH = (1 << 31) - 1  # cudaDevAttrMaxPitch on current GPUs: wider pitches go span by span


class CudaCopier:
    """Span copies on CUDA through :mod:`kvmove.memory.cuda_api` (``api``: any object with its
    ``memcpy_async``, ``memcpy_2d_async``, ``memcpy_batch`` and ``has_memcpy_batch``)."""

    def __init__(self, api=cuda_api):
        self.api = api
        self.batch_failures = 0  # batches the driver refused (each fell back, in its call)
        self._lock = threading.Lock()

    @property
    def has_batch(self) -> bool:
        return self.api.has_memcpy_batch()

    def per_span(self, dsts: list, srcs: list, sizes: list, stream: int) -> int:
        copy = self.api.memcpy_async
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            copy(d, s, n, stream)
        return len(dsts)

    def per_column(self, dsts: list, srcs: list, widths: list, dst_pitch: int,
                   src_pitch: int, height: int, stream: int) -> int:
        """One 2-D copy per span: ``height`` repeats of ``widths[i]`` bytes, ``dst_pitch`` /
        ``src_pitch`` apart."""
        copy = self.api.memcpy_2d_async
        for d, s, w in zip(dsts, srcs, widths, strict=True):
            copy(d, dst_pitch, s, src_pitch, w, height, stream)
        return len(dsts)

    def batched(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, *,
                device: int, src_location: tuple[int, int],
                dst_location: tuple[int, int]) -> int:
        """Every span, one batched call per ``MAX_BATCH`` spans on ``stream`` (not the legacy
        default stream). A batch the driver refuses was not enqueued: it and the spans after
        it go span by span, in this call only (the next call batches again); no span is
        enqueued twice. Returns the number of copy calls issued."""
        calls = 0
        for start in range(0, len(dsts), MAX_BATCH):
            stop = start + MAX_BATCH
            try:
                self.api.memcpy_batch(dsts[start:stop], srcs[start:stop], sizes[start:stop],
                                      stream, device=device, src_location=src_location,
                                      dst_location=dst_location)
            except cuda_api.BatchRefused as e:
                with self._lock:
                    self.batch_failures += 1
                    first = self.batch_failures == 1
                (log.warning if first else log.debug)(
                    "%s (spans %d..%d of %d); copying them span by span", e, start,
                    min(stop, len(dsts)) - 1, len(dsts))
                return calls + self.per_span(dsts[start:].tolist(), srcs[start:].tolist(),
                                             sizes[start:].tolist(), stream)
            calls += 1
        return calls


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
            here = (cuda_api.LOCATION_DEVICE, device.index or 0)
            there = (cuda_api.LOCATION_HOST, 0)
            # The batched call refuses the legacy default stream (torch's default, 0): there
            # it goes to the per-thread default stream, which the legacy stream orders
            # against both ways, so the copies still run after the work before them.
            return copier.batched(dsts, srcs, sizes, stream or cuda_api.STREAM_PER_THREAD,
                                  device=torch.cuda.current_device(),
                                  src_location=here if src_on_device else there,
                                  dst_location=here if dst_on_device else there)
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
