"""The torch reference backend of the row copy: ``index_select`` / ``index_copy_`` on byte
views, one layer at a time. The correctness oracle in tests, and the fast path on a machine
without a GPU. It honours the kernel's contract: ``-1`` skips, out-of-range rows are
skipped and counted, nothing is written outside a pool."""

from __future__ import annotations

import torch

from kvmove.row_pool import BufferRows


def _contiguous_start(rows: torch.Tensor) -> int | None:
    """``rows[0]`` if ``rows`` is ``rows[0], rows[0] + 1, ...``, else None."""
    m = rows.numel()
    if m == 0:
        return None
    first, last = int(rows[0]), int(rows[-1])
    if last - first != m - 1:
        return None
    if m > 1 and not bool((rows[1:] - rows[:-1] == 1).all()):
        return None
    return first


def copy_rows_torch(
    src: BufferRows,
    dst: BufferRows,
    layers: list[int],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    errors: torch.Tensor | None,
) -> None:
    """Copy ``src_rows[i] -> dst_rows[i]`` for each layer in ``layers`` of one buffer; add
    the number of out-of-range rows to ``errors`` (unless None)."""
    s = src_rows.to(torch.int64).reshape(-1)
    d = dst_rows.to(torch.int64).reshape(-1)
    bad = (s < -1) | (s >= src.num_rows) | (d < -1) | (d >= dst.num_rows)
    if errors is not None and bool(bad.any()):
        errors += int(bad.sum())
    keep = (s >= 0) & (d >= 0) & ~bad
    if not bool(keep.all()):
        s, d = s[keep], d[keep]
    if s.numel() == 0:
        return
    s_src = s.to(src.device)
    d_dst = d.to(dst.device)
    same_device = src.device == dst.device
    d0 = _contiguous_start(d) if same_device else None
    s0 = _contiguous_start(s) if same_device and d0 is None else None
    m = s.numel()
    for layer in layers:
        src_l, dst_l = src.layers[layer], dst.layers[layer]
        if d0 is not None and dst_l[d0 : d0 + m].is_contiguous():
            torch.index_select(src_l, 0, s_src, out=dst_l[d0 : d0 + m])
        elif s0 is not None:
            dst_l.index_copy_(0, d_dst, src_l[s0 : s0 + m])
        else:
            dst_l.index_copy_(0, d_dst, src_l.index_select(0, s_src).to(dst.device))
