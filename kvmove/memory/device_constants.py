"""Constants a copy keeps on a GPU (per-layer address tables, ring row numbers): made once,
read by kernels on any stream, and made without waiting for the work the caller's streams
have queued. :func:`device_constant` uploads on a private stream and waits for that stream
alone. Constants are kept for the life of the process, one per device and value: they are
few and small, and a kernel queued on any stream may still read one after its maker is gone.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[int, torch.cuda.Stream] = {}
_kept: dict[tuple, torch.Tensor] = {}  # (device index, dtype, shape, bytes) -> constant
_lock = threading.Lock()


def _upload_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            # torch's streams are created non-blocking: they never wait for the legacy
            # default stream, where an engine's work may be queued.
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def device_constant(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (a CPU tensor) as a tensor on ``device``, complete when this returns:
    uploaded on a private stream that is synchronised alone (never the caller's streams),
    and kept (equal values on the same device share one). On the CPU, ``values`` itself.
    Refused under CUDA-graph capture: constants are made in the warm-up, as every copy
    makes them."""
    if device.type != "cuda":
        return values
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a kvmove device constant (a pointer table or ring rows) was first needed during "
            "CUDA-graph capture: run the copy once before capturing it (the warm-up)")
    # Not torch.tensor(values).to(device): that upload is enqueued on the caller's stream,
    # and from pageable memory the driver first waits for that stream to drain, so a new
    # cache's first call in the decode loop would stall the engine's thread until its
    # kernels end; and a tensor uploaded on one stream is not safe to read from another
    # until that stream gets there. Kept for good: torch's caching allocator would hand
    # freed memory to the next upload with no order after a kernel still reading it.
    stream = _upload_stream(device)
    values = values.contiguous()
    key = (stream.device_index, values.dtype, tuple(values.shape), values.numpy().tobytes())
    with _lock:
        kept = _kept.get(key)
    if kept is not None:
        return kept
    with torch.cuda.stream(stream):
        out = values.to(device, non_blocking=True)
    stream.synchronize()
    with _lock:
        return _kept.setdefault(key, out)
