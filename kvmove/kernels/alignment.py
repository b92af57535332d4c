"""The one alignment rule of every copy: the largest power of two (up to a cap) that
divides a set of byte quantities (base addresses, pitches, row sizes). The kernel's vector
width and the torch backend's element type both follow from it."""

from __future__ import annotations

MAX_ALIGNMENT = 16  # bytes: the widest access either backend makes


def pow2_alignment(*values: int, cap: int = MAX_ALIGNMENT) -> int:
    """The largest power of two, at most ``cap``, dividing every value (``cap`` for none)."""
    a = cap
    for v in values:
        while a > 1 and v % a:
            a //= 2
    return a
