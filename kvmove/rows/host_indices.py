"""Index tensors from the host to a GPU, as the decode loop needs them: without a host
sync and without reading the caller's buffer after the call.

A ``.to(device, non_blocking=True)`` of host memory is neither: from pageable memory the
driver first waits for the stream to drain (``cudaMemcpyAsync`` from pageable memory is
synchronous with respect to the host), and from pinned memory it reads the caller's buffer
whenever the stream gets there, so an engine that refills its index buffer right after the
call changes which rows move. :func:`to_device` copies the values into a private pinned
buffer on the host first (a memcpy of a few KiB, done when it returns) and enqueues the
upload from there. The buffer comes from torch's caching host allocator, which keeps it
until the upload has run on the device, so nothing is allocated from the driver per call
once the sizes have been seen.
"""

from __future__ import annotations

import torch


def to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` on ``device``: itself when it is there already (or ``device`` is the CPU);
    else a copy enqueued on the current stream of ``device`` from a private pinned snapshot
    taken now. Never waits for the device."""
    if device.type != "cuda" or rows.device == device:
        return rows
    if rows.device.type != "cpu":  # another GPU: device to device, in stream order
        return rows.to(device, non_blocking=True)
    snapshot = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    snapshot.copy_(rows)
    return snapshot.to(device, non_blocking=True)


def pair_to_device(a: torch.Tensor, b: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_device` of two index tensors, in one upload where both are on the host
    (one snapshot holding both, as int64, then two views of its copy on the device): a
    call's pages and slots cost one enqueue, not two."""
    if device.type != "cuda" or not (a.device.type == b.device.type == "cpu"):
        return to_device(a, device), to_device(b, device)
    n = a.numel()
    snapshot = torch.empty(n + b.numel(), dtype=torch.int64, pin_memory=True)
    snapshot[:n].copy_(a.reshape(-1))
    snapshot[n:].copy_(b.reshape(-1))
    both = snapshot.to(device, non_blocking=True)
    return both[:n].view(a.shape), both[n:].view(b.shape)
