"""Constants a copy keeps on a GPU (per-layer address tables, ring row numbers): made once,
read by kernels on any stream, and made without waiting for the work the caller's streams
have queued.

A plain ``torch.tensor(values).to(device)`` is none of that: the upload is enqueued on the
caller's current stream, and from pageable memory the driver first waits for that stream to
drain, so the first call of a new cache (or layer set) inside the decode loop stalls the
engine's thread until its kernels end. And a tensor uploaded on one stream is not safe to
read from another until that stream gets there. :func:`device_constant` uploads on a private
stream of its own, which holds nothing else, and waits for that stream alone: the constant
is complete on the device when it returns (any stream may read it), and the caller's
streams are neither waited for nor given work.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[int, torch.cuda.Stream] = {}
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
    uploaded on a private stream that is synchronised alone (never the caller's streams).
    On the CPU, ``values`` itself. Not for use under CUDA-graph capture (make constants in
    the warm-up, as every copy does)."""
    if device.type != "cuda":
        return values
    stream = _upload_stream(device)
    with torch.cuda.stream(stream):
        out = values.to(device, non_blocking=True)
    stream.synchronize()
    return out
