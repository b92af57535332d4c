"""Staging row numbers of pages: slot ``s`` of a staging of ``page_tokens``-token pages is
rows ``s * page_tokens .. s * page_tokens + page_tokens - 1`` of its row pool."""

from __future__ import annotations

import numpy as np
import torch


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
