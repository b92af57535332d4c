"""Index lists for the copy kernels' tests."""

from __future__ import annotations


def first_only(values: list[int], limit: int) -> list[int]:
    """``values`` with each repeat of an in-range value (``0 <= v < limit``) made -1: two
    copies to one destination race, in the kernel as on a GPU (KVMover refuses repeated KV
    rows; staging slots are allocated once)."""
    seen, out = set(), []
    for v in values:
        out.append(-1 if 0 <= v < limit and v in seen else v)
        seen.add(v)
    return out
