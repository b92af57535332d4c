"""The two-hop (copy-engine) path of the row copy.

Instead of the kernel writing host memory row by row (the direct path), rows pass through
a ring beside the KV buffer (:mod:`kvmove.device_ring`):

- gather (KV -> host): the row-copy kernel packs the KV rows into the ring at HBM speed,
  then the copy engine moves each run of consecutive host rows as one span per layer
  (:func:`kvmove.copy_engine.copy_spans`: one batched call, or one async copy per span);
- scatter (host -> KV): the copy engine moves the host spans into the ring, then the kernel
  scatters the ring rows into the KV.

The SMs are busy only for the device-side copy. With layer-first staging and contiguous
slots each layer is a single span, so the copy engine sees a few large copies.

The code is device-agnostic: on a machine without a GPU the ring is host memory, the
device-side copy is the torch backend (or the Triton interpreter) and a span is a
``memmove``; the tests check its bytes against the torch backend there.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmove.copy_engine import copy_spans
from kvmove.device_ring import ring_for
from kvmove.row_pool import BufferRows
from kvmove.torch_backend import copy_rows_torch


def host_spans(host: BufferRows, host_rows: np.ndarray, ring: BufferRows,
               layers: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The spans between ring rows ``0..k-1`` and host rows ``host_rows`` (``[k]``), for each
    layer: one span per run of consecutive host rows (per row where the host pitch exceeds
    the row). Returns ``(host_addresses, ring_addresses, sizes)``, layer-major."""
    k = len(host_rows)
    rb = host.row_bytes
    if k == 0 or not layers:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if host.pitch == rb:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(host_rows) != 1) + 1))
    else:
        starts = np.arange(k)
    lengths = np.diff(np.append(starts, k))
    host_base = np.array([host.device_addresses[i] for i in layers], dtype=np.int64)
    ring_base = np.array([ring.device_addresses[i] for i in layers], dtype=np.int64)
    host_addr = host_base[:, None] + (host_rows[starts] * host.pitch)[None, :]
    ring_addr = ring_base[:, None] + (starts * rb)[None, :]
    sizes = np.broadcast_to(lengths * rb, host_addr.shape)
    return host_addr.reshape(-1), ring_addr.reshape(-1), sizes.reshape(-1)


def _device_copy(src, dst, layers, src_rows, dst_rows, *, inner, direction, page_tokens):
    if inner == "triton":
        from kvmove.copy import _launch_triton

        device = src.device if src.device.type != "cpu" else dst.device
        _launch_triton(src, dst, layers, src_rows.to(device), dst_rows.to(device), None,
                       direction, page_tokens, device)
    elif inner == "torch":
        copy_rows_torch(src, dst, layers, src_rows, dst_rows, None)
    else:
        raise ValueError(f"inner must be 'triton' or 'torch', got {inner!r}")


def copy_rows_two_hop(
    src: BufferRows,
    dst: BufferRows,
    layers: list[int],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    errors: torch.Tensor | None,
    *,
    direction: str,
    page_tokens: int = 1,
    inner: str | None = None,
) -> None:
    """Copy ``src_rows[i] -> dst_rows[i]`` for each layer in ``layers`` of one buffer, through
    the ring of the KV side (``src`` for a gather, ``dst`` for a scatter). Same contract as
    the other backends: ``-1`` skips, out-of-range rows are skipped and added to ``errors``.

    ``inner`` is the device-side copy: ``"triton"`` (default on CUDA) or ``"torch"``
    (default elsewhere).
    """
    if direction not in ("gather", "scatter"):
        raise ValueError(f"direction must be 'gather' or 'scatter', got {direction!r}")
    s = src_rows.to("cpu", torch.int64).reshape(-1)
    d = dst_rows.to("cpu", torch.int64).reshape(-1)
    bad = (s < -1) | (s >= src.num_rows) | (d < -1) | (d >= dst.num_rows)
    if errors is not None and bool(bad.any()):
        errors += int(bad.sum())
    keep = (s >= 0) & (d >= 0) & ~bad
    s, d = s[keep].numpy(), d[keep].numpy()
    if len(s) == 0 or not layers:
        return
    gathering = direction == "gather"
    kv, host = (src, dst) if gathering else (dst, src)
    kv_rows, host_rows = (s, d) if gathering else (d, s)
    if inner is None:
        inner = "triton" if kv.device.type == "cuda" else "torch"
    ring = ring_for(kv)
    kv_on_device = kv.device.type == "cuda"
    host_on_device = host.device.type == "cuda"
    with ring.use():
        for start in range(0, len(kv_rows), ring.capacity):
            k_rows = torch.from_numpy(kv_rows[start:start + ring.capacity])
            h_rows = host_rows[start:start + ring.capacity]
            r_rows = torch.arange(len(k_rows), dtype=torch.int64)
            host_addr, ring_addr, sizes = host_spans(host, h_rows, ring.rows, layers)
            if gathering:
                _device_copy(kv, ring.rows, layers, k_rows, r_rows, inner=inner,
                             direction=direction, page_tokens=page_tokens)
                copy_spans(host_addr, ring_addr, sizes, device=kv.device,
                           src_on_device=kv_on_device, dst_on_device=host_on_device)
            else:
                copy_spans(ring_addr, host_addr, sizes, device=kv.device,
                           src_on_device=host_on_device, dst_on_device=kv_on_device)
                _device_copy(ring.rows, kv, layers, r_rows, k_rows, inner=inner,
                             direction=direction, page_tokens=page_tokens)
