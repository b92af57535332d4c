"""Validation and composition of row indices: the checks ``check=True`` runs before
anything is written, and the mapping of (slot, token) to staging row numbers."""

from __future__ import annotations

import numbers

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def as_index_tensor(value, name: str, *, dim: int) -> torch.Tensor:
    """``value`` as an int32/int64 tensor of ``dim`` dimensions, or a clear error naming
    ``name``. Lists and tuples of ints are accepted and become int64."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)):
            flat = value if dim == 1 else [x for row in value for x in row]
            if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in flat):
                raise TypeError(f"{name} must hold integers, got {value!r:.80}")
            value = torch.tensor(value, dtype=torch.int64)
            if value.numel() == 0:
                value = value.reshape((0,) * dim if dim == 1 else (0, 0))
        else:
            raise TypeError(f"{name} must be an int32/int64 tensor, got {type(value).__name__}")
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {value.dtype}")
    if value.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(value.shape)}")
    return value


def check_range(rows: torch.Tensor, limit: int, name: str) -> None:
    """Every entry is ``-1`` or in ``[0, limit)``; else ``IndexError`` with the first bad
    value and its position."""
    if rows.numel() == 0:
        return
    flat = rows.reshape(-1)
    bad = (flat < -1) | (flat >= limit)
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0, 0])
        raise IndexError(
            f"{name}[{pos}] = {int(flat[pos])} is out of range: valid values are -1 "
            f"(skip) and 0..{limit - 1}"
        )


def check_unique(rows: torch.Tensor, name: str) -> None:
    """No destination row named twice (``-1`` excepted): the result would depend on order."""
    flat = rows.reshape(-1)
    flat = flat[flat >= 0]
    if flat.numel() < 2:
        return
    uniq, counts = torch.unique(flat, return_counts=True)
    if int(counts.max()) > 1:
        dup = int(uniq[counts > 1][0])
        raise ValueError(f"{name} names row/slot {dup} more than once; destinations must be unique")


def page_rows(slots: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """Staging row numbers ``[n * page_tokens]`` of the pages in ``slots`` (``-1`` -> ``-1``)."""
    slots = slots.to(torch.int64)
    t = torch.arange(page_tokens, dtype=torch.int64, device=slots.device)
    rows = slots[:, None] * page_tokens + t[None, :]
    return torch.where(slots[:, None] == -1, torch.full_like(rows, -1), rows).reshape(-1)
