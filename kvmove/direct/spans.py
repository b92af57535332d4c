"""The spans of a direct send: which bytes of the sender's staging go where in the
receiver's pool, cut into calls the transport handles (numpy over every unit of every page,
no Python loop over pages or layers). A unit is the largest piece contiguous on both sides
by the layouts alone: a whole page of one buffer (both page-first), one layer of a page
(layer-first staging into a layer_first or page_first_direct pool), else one row. Units
that touch on both sides in one buffer merge into one span; spans over
:data:`MAX_SPAN_BYTES` are cut; a call holds at most :data:`MAX_SPANS_PER_CALL` spans and
about :data:`MAX_BYTES_PER_CALL` bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmove.direct.handle import BufferPlace

# Mooncake's limits (0.3.13, TCP; measured): more than about 2048 spans in flight from one
# engine to one peer fail the call (and under concurrency can break that connection for
# good), and a call's deadline does not grow with its span count: so calls stay at 1000
# spans and tens of MiB, one at a time per peer.
MAX_SPANS_PER_CALL = 1000
MAX_BYTES_PER_CALL = 64 << 20
MAX_SPAN_BYTES = 16 << 20


@dataclass
class SpanPlan:
    """The calls of one send. Call ``k`` writes spans ``bounds[k]:bounds[k + 1]`` of
    ``srcs`` / ``dsts`` / ``lengths``; page ``i`` (in the caller's order) is in place once
    calls ``0 .. last_call[i]`` have succeeded; ``page_bytes[i]``: its bytes."""

    srcs: list[int]
    dsts: list[int]
    lengths: list[int]
    bounds: list[int]
    last_call: np.ndarray
    page_bytes: np.ndarray

    @property
    def num_calls(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_spans(self) -> int:
        return len(self.lengths)

    def call(self, k: int) -> tuple[list[int], list[int], list[int]]:
        a, b = self.bounds[k], self.bounds[k + 1]
        return self.srcs[a:b], self.dsts[a:b], self.lengths[a:b]

    def landed(self, calls_ok: int) -> np.ndarray:
        """bool ``[n]``: the pages that every one of the first ``calls_ok`` calls wrote in
        full (the calls after them failed or were not made)."""
        return self.last_call < calls_ok


def _units(s: BufferPlace, d: BufferPlace, slots: np.ndarray, pages: np.ndarray,
           valid: np.ndarray, layers: np.ndarray, page_tokens: int):
    """(src, dst, length, page index) of every unit of one buffer, in merge order: layers,
    then the pages (as given: sorted by destination), then tokens."""
    row = s.row_bytes
    index = np.arange(pages.size, dtype=np.int64)
    every_layer = layers.size == s.layers
    if every_layer and all(p.layer_stride == row and p.token_stride == s.layers * row
                           for p in (s, d)):  # page-first on both sides: whole pages
        return (s.origin + slots * s.page_stride, d.origin + pages * d.page_stride,
                valid * (s.layers * row), index)
    src = (s.origin + layers * s.layer_stride)[:, None] + slots * s.page_stride
    dst = (d.origin + layers * d.layer_stride)[:, None] + pages * d.page_stride
    if s.token_stride == row and d.token_stride == row:  # one layer of a page
        shape = src.shape
        return (src.ravel(), dst.ravel(), np.broadcast_to(valid * row, shape).ravel(),
                np.broadcast_to(index, shape).ravel())
    tokens = np.arange(page_tokens, dtype=np.int64)
    keep = np.broadcast_to(tokens < valid[:, None], (layers.size, *valid.shape,
                                                     page_tokens)).ravel()
    src = (src[:, :, None] + tokens * s.token_stride).ravel()[keep]
    dst = (dst[:, :, None] + tokens * d.token_stride).ravel()[keep]
    page = np.broadcast_to(index[:, None], (layers.size, index.size, page_tokens)).ravel()
    return src, dst, np.full(src.size, row, dtype=np.int64), page[keep]


def plan_spans(src: Sequence[BufferPlace], dst: Sequence[BufferPlace], slots: np.ndarray,
               pages: np.ndarray, valid: np.ndarray, layer: int | None,
               page_tokens: int) -> SpanPlan:
    """The :class:`SpanPlan` of writing, for each page ``i``, the first ``valid[i]`` tokens
    of staging slot ``slots[i]`` (places ``src``, one per buffer) into page ``pages[i]``
    of the receiver (places ``dst``, the same buffers in the same order): every layer
    (``layer=None``) or layer ``layer`` of each buffer that has it. Arguments are trusted
    (validated by the caller); a span outside its destination region raises
    ``ValueError`` (it cannot happen with a checked handle)."""
    n = pages.size
    order = np.argsort(pages, kind="stable")  # merge order: by destination page
    parts, buffer_of = [], []
    for b, (s, d) in enumerate(zip(src, dst, strict=True)):
        if layer is None:
            layers = np.arange(s.layers, dtype=np.int64)
        elif layer < s.layers:
            layers = np.array([layer], dtype=np.int64)
        else:
            continue
        u_src, u_dst, u_len, u_page = _units(s, d, slots[order], pages[order], valid[order],
                                             layers, page_tokens)
        parts.append((u_src, u_dst, u_len, order[u_page]))
        buffer_of.append(np.full(u_src.size, b, dtype=np.int64))
    u_src, u_dst, u_len, u_page = (np.concatenate(c) for c in zip(*parts, strict=True))
    u_buf = np.concatenate(buffer_of)

    # Merge neighbours that touch on both sides, within one buffer.
    joins = ((u_buf[1:] == u_buf[:-1]) & (u_src[:-1] + u_len[:-1] == u_src[1:])
             & (u_dst[:-1] + u_len[:-1] == u_dst[1:]))
    new_span = np.concatenate(([True], ~joins))
    starts = np.flatnonzero(new_span)
    span_src, span_dst = u_src[starts], u_dst[starts]
    span_len = np.add.reduceat(u_len, starts)
    span_buf = u_buf[starts]
    span_of_unit = np.cumsum(new_span) - 1
    _check_inside(dst, span_buf, span_dst, span_len)

    page_bytes = np.bincount(u_page, weights=u_len, minlength=n).astype(np.int64)
    total = int(span_len.sum())
    if (span_len.size <= MAX_SPANS_PER_CALL and total <= MAX_BYTES_PER_CALL
            and int(span_len.max()) <= MAX_SPAN_BYTES):  # one call: the common case
        return SpanPlan(span_src.tolist(), span_dst.tolist(), span_len.tolist(),
                        [0, int(span_len.size)], np.zeros(n, dtype=np.int64), page_bytes)
    # Cut long spans; then calls of at most MAX_SPANS_PER_CALL spans and ~MAX_BYTES bytes.
    cuts = -(-span_len // MAX_SPAN_BYTES)
    if int(cuts.max()) > 1:
        of = np.repeat(np.arange(span_len.size), cuts)
        first = np.cumsum(cuts) - cuts
        offset = (np.arange(of.size) - first[of]) * MAX_SPAN_BYTES
        span_src, span_dst = span_src[of] + offset, span_dst[of] + offset
        span_len = np.minimum(span_len[of] - offset, MAX_SPAN_BYTES)
    last_piece = np.cumsum(cuts) - 1
    by_bytes = (np.cumsum(span_len) - span_len) // MAX_BYTES_PER_CALL
    new_group = np.concatenate(([True], by_bytes[1:] != by_bytes[:-1]))
    group = np.cumsum(new_group) - 1
    rank = np.arange(by_bytes.size) - np.flatnonzero(new_group)[group]
    key = group * (span_len.size + 1) + rank // MAX_SPANS_PER_CALL
    new_call = np.concatenate(([True], key[1:] != key[:-1]))
    call_of = np.cumsum(new_call) - 1
    last_call = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_call, u_page, call_of[last_piece[span_of_unit]])
    bounds = [*np.flatnonzero(new_call).tolist(), int(span_len.size)]
    return SpanPlan(span_src.tolist(), span_dst.tolist(), span_len.tolist(), bounds,
                    last_call, page_bytes)


def _check_inside(dst: Sequence[BufferPlace], buf: np.ndarray, start: np.ndarray,
                  length: np.ndarray) -> None:
    low = np.array([d.address for d in dst], dtype=np.int64)[buf]
    high = np.array([d.address + d.nbytes for d in dst], dtype=np.int64)[buf]
    bad = np.flatnonzero((start < low) | (start + length > high))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"a span {int(start[i]):#x} + {int(length[i])} lies outside buffer "
                         f"{dst[int(buf[i])].name!r}'s region of the receiver's handle")
