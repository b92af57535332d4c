"""Validation and composition of row indices: the checks ``check=True`` runs before
anything is written, and the mapping of (slot, token) to staging row numbers."""

from __future__ import annotations

import numbers

import numpy as np
import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def as_index_tensor(value, name: str, *, dim: int, device: torch.device | None = None
                    ) -> torch.Tensor:
    """``value`` as an int32/int64 tensor of ``dim`` dimensions, on the CPU or ``device``,
    or a clear error naming ``name``. Lists and tuples of ints are accepted (int64)."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)):
            rows = value if dim == 2 else [value]
            if not all(isinstance(row, (list, tuple)) for row in rows) or not all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool)
                for row in rows for x in row
            ):
                raise TypeError(f"{name} must hold integers in {dim} dimension(s), "
                                f"got {value!r:.80}")
            try:
                value = torch.tensor(value, dtype=torch.int64)
            except (RuntimeError, ValueError, OverflowError) as e:
                raise ValueError(f"{name} is not a valid index list: {e}") from None
            if value.numel() == 0:
                value = value.reshape((0,) * dim if dim == 1 else (0, 0))
        else:
            raise TypeError(f"{name} must be an int32/int64 tensor, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(value.shape)}")
    if value.device.type != "cpu" and value.device != device:
        raise ValueError(
            f"{name} is on {value.device}; indices must be on the CPU"
            + (f" or {device}" if device is not None and device.type != "cpu" else "")
        )
    return value


def _values(rows: torch.Tensor | np.ndarray) -> np.ndarray:
    """The flat values of a CPU index tensor, as a numpy view (small arrays cost a fraction
    of what torch ops do per call). The checks here run on the host only: a device tensor
    would have to be waited for, so callers leave those to the kernel's error counter."""
    if isinstance(rows, np.ndarray):
        return rows.reshape(-1)
    if rows.device.type != "cpu":
        raise TypeError(f"host-side index check of a tensor on {rows.device}")
    return rows.reshape(-1).numpy()


def check_range(rows: torch.Tensor, limit: int, name: str) -> None:
    """Every entry is ``-1`` or in ``[0, limit)``; else ``IndexError`` with the first bad
    value and its position."""
    if rows.numel() == 0:
        return
    a = _values(rows)
    if int(a.min()) >= -1 and int(a.max()) < limit:
        return
    pos = int(np.flatnonzero((a < -1) | (a >= limit))[0])
    raise IndexError(
        f"{name}[{pos}] = {int(a[pos])} is out of range: valid values are -1 "
        f"(skip) and 0..{limit - 1}"
    )


def check_unique(rows: torch.Tensor | np.ndarray, name: str, *, page_tokens: int = 1) -> None:
    """No destination row named twice (``-1`` excepted): the result would depend on order.
    ``rows`` may be page numbers of whole pages of ``page_tokens`` rows (the message names
    the page's first row)."""
    a = _values(rows)
    if a.shape[0] < 2 or bool((a[1:] > a[:-1]).all()):  # strictly increasing: no sort
        return
    kept = np.sort(a[a >= 0])
    dups = kept[1:][kept[1:] == kept[:-1]]
    if dups.size:
        raise ValueError(f"{name} names row/slot {int(dups[0]) * page_tokens} more than "
                         "once; destinations must be unique")


def check_disjoint(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Within one pool, no row is both read and written (``-1`` excepted): the result would
    depend on the order of the copies."""
    a, b = _values(src_rows), _values(dst_rows)
    shared = np.intersect1d(a[a >= 0], b[b >= 0])
    if shared.size:
        raise ValueError(f"src_rows and dst_rows both name row {int(shared[0])} of the same "
                         "pool: a copy within one pool must not write a row it reads")


def page_rows(slots: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Staging row numbers ``[n * page_tokens]`` of the pages in ``slots``: slot ``s`` ->
    rows ``s * page_tokens + t``, ``-1`` -> ``-1`` (skip). Any other slot whose rows would
    be negative or past int64 gives rows of ``-2``, which every backend counts as out of
    range (an overflowing product must not wrap around onto a real row)."""
    if slots.device.type == "cpu":  # numpy: a few microseconds instead of tens
        a = slots.numpy().astype(np.int64)
        rows = a[:, None] * page_tokens + np.arange(page_tokens, dtype=np.int64)[None, :]
        largest = _largest_slot(page_tokens)
        if a.size and (a.min() < 0 or a.max() > largest):
            rows[a == -1] = -1
            rows[(a < -1) | (a > largest)] = -2
        return torch.from_numpy(rows.reshape(-1))
    return page_rows_on_device(slots, page_tokens)


def _largest_slot(page_tokens: int) -> int:
    """The largest slot whose rows ``slot * page_tokens + t`` fit int64."""
    return (np.iinfo(np.int64).max - page_tokens + 1) // page_tokens


def page_rows_on_device(slots: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """:func:`page_rows` in torch ops on the slots' device, without waiting for it (no
    test of a device value on the host)."""
    slots = slots.to(torch.int64)[:, None]
    t = torch.arange(page_tokens, dtype=torch.int64, device=slots.device)
    bad = (slots < -1) | (slots > _largest_slot(page_tokens))
    rows = torch.where(bad, -2, slots * page_tokens + t)
    return torch.where(slots == -1, -1, rows).reshape(-1)


def as_int_array(value, name: str) -> np.ndarray:
    """``value`` (tensor, array or sequence of ints) as a 1-D int64 numpy array."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must hold integers, got a tensor of {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.is_meta:
            raise TypeError(f"{name} must be a tensor with data, got a meta tensor")
        return value.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must hold integers, got {type(value).__name__} {value!r}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise TypeError(f"{name} must be a sequence of integers, got {value!r:.80} ({e})") \
            from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {type(value).__name__} of shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer) or (
        arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max
    ):
        items = value if isinstance(value, (list, tuple)) else arr.tolist()
        bad = next((v for v in items if isinstance(v, bool) or not isinstance(v, int)
                    or not -(2**63) <= v < 2**63), arr[0])
        raise TypeError(f"{name} must hold int64 integers, got {bad!r:.40}")
    return arr.astype(np.int64, copy=False)
