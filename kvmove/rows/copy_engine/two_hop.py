"""The two-hop (copy-engine) path of the row copy: rows pass through a ring beside the KV
buffer (:mod:`kvmove.rows.copy_engine.device_ring`). A gather packs the KV rows into the
ring with the row-copy kernel, then the copy engine moves each run of host rows as one span
per layer (:func:`~kvmove.rows.copy_engine.span_copies.copy_span_grid`); a scatter runs the
other way. The SMs are busy only for the device-side copy. Row numbers are taken on the
host only (a call whose rows live on the device goes to the direct kernel instead). Without
a GPU the ring is host memory and the device-side copy is the torch backend.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmove.memory import cuda_api
from kvmove.memory.row_pool import BufferRows
from kvmove.rows.copy_engine.device_ring import ring_for
from kvmove.rows.copy_engine.span_copies import copy_span_grid, cuda_copier
from kvmove.rows.host_indices import to_device
from kvmove.rows.torch_backend.reference import copy_rows_torch
from kvmove.rows.triton_backend.launcher import kernel_args, launch


def span_grid(host: BufferRows, host_rows: np.ndarray, ring: BufferRows,
              layers: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]:
    """The spans between ring rows ``0..k-1`` and host rows ``host_rows`` (``[k]``): one span
    per run of consecutive host rows (per row where the host pitch exceeds the row), in
    every layer of ``layers``. Returns ``(host_addresses, ring_addresses, sizes,
    host_pitch, ring_pitch, height)``: the spans of the first layer, repeated ``height``
    times at those pitches, where the layers are evenly spaced on both sides (always, for
    all layers of a staging buffer and its ring); else every span listed, height 1."""
    k = len(host_rows)
    rb = host.row_bytes
    if k == 0 or not layers:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, 0, 0, 1
    if host.pitch == rb:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(host_rows) != 1) + 1))
    else:
        starts = np.arange(k)
    sizes = np.diff(np.append(starts, k)) * rb
    host_base = np.array([host.device_addresses[i] for i in layers], dtype=np.int64)
    ring_base = np.array([ring.device_addresses[i] for i in layers], dtype=np.int64)
    host_off, ring_off = host_rows[starts] * host.pitch, starts * rb
    steps = np.diff(host_base), np.diff(ring_base)
    if len(layers) == 1 or all(int(d[0]) > 0 and bool((d == d[0]).all()) for d in steps):
        pitches = (int(steps[0][0]), int(steps[1][0])) if len(layers) > 1 else (0, 0)
        return (host_base[0] + host_off, ring_base[0] + ring_off, sizes, *pitches,
                len(layers))
    host_addr = (host_base[:, None] + host_off[None, :]).reshape(-1)
    ring_addr = (ring_base[:, None] + ring_off[None, :]).reshape(-1)
    return host_addr, ring_addr, np.tile(sizes, len(layers)), 0, 0, 1


def _device_copy(src, dst, layers, src_rows, dst_rows, *, inner, direction, page_tokens):
    if inner == "triton":
        device = src.device if src.device.type != "cpu" else dst.device
        args = kernel_args(src, dst, tuple(layers), device, direction=direction,
                           page_tokens=page_tokens)
        launch(args, to_device(src_rows, device), to_device(dst_rows, device), None)
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

    ``src_rows`` and ``dst_rows`` must be host tensors: the spans are worked out on the host,
    and reading device rows there would wait for the device (a ``ValueError`` says so
    before anything is read). ``inner`` is the device-side copy: ``"triton"`` (default on
    CUDA) or ``"torch"`` (default elsewhere).
    """
    if direction not in ("gather", "scatter"):
        raise ValueError(f"direction must be 'gather' or 'scatter', got {direction!r}")
    for name, rows in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if rows.device.type != "cpu":
            raise ValueError(f"the two-hop path reads {name} on the host, got a tensor on "
                             f"{rows.device} (device-resident rows go to the direct kernel)")
    s = src_rows.to(torch.int64).reshape(-1)
    d = dst_rows.to(torch.int64).reshape(-1)
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
            r_rows = ring.row_numbers(len(k_rows))
            host_addr, ring_addr, sizes, host_pitch, ring_pitch, height = span_grid(
                host, h_rows, ring.rows, layers)
            if gathering:
                _device_copy(kv, ring.rows, layers, k_rows, r_rows, inner=inner,
                             direction=direction, page_tokens=page_tokens)
                copy_span_grid(host_addr, ring_addr, sizes, height=height,
                               dst_pitch=host_pitch, src_pitch=ring_pitch, device=kv.device,
                               src_on_device=kv_on_device, dst_on_device=host_on_device)
            else:
                copy_span_grid(ring_addr, host_addr, sizes, height=height,
                               dst_pitch=ring_pitch, src_pitch=host_pitch, device=kv.device,
                               src_on_device=host_on_device, dst_on_device=kv_on_device)
                _device_copy(ring.rows, kv, layers, r_rows, k_rows, inner=inner,
                             direction=direction, page_tokens=page_tokens)


def warm_up(src: BufferRows, dst: BufferRows, layers, *, direction: str,
            page_tokens: int = 1) -> None:
    """Before serving (CUDA): make the ring of the KV side, load the copy-engine bindings
    (a :class:`~kvmove.memory.cuda_api.CudaApiError` names what is missing) and compile
    the device-side copy with its tables, by a launch whose only row is skipped, on the
    current stream. Writes nothing."""
    gathering = direction == "gather"
    kv = src if gathering else dst
    if kv.device.type != "cuda" or not layers:
        return
    problem = cuda_api.copy_engine_problem()
    if problem is not None:
        raise cuda_api.CudaApiError(f"backend two_hop: {problem}")
    cuda_copier().has_batch  # noqa: B018  (asks the driver once, now)
    ring = ring_for(kv)
    skip = torch.full((1,), -1, dtype=torch.int64, device=kv.device)
    with ring.use():
        if gathering:
            _device_copy(kv, ring.rows, list(layers), skip, skip, inner="triton",
                         direction=direction, page_tokens=page_tokens)
        else:
            _device_copy(ring.rows, kv, list(layers), skip, skip, inner="triton",
                         direction=direction, page_tokens=page_tokens)
