"""The pages of a :class:`~kvmove.KVCache` described in place: per-key multi-buffer
descriptors whose spans are the KV rows themselves, so that the store reads (put) and
writes (get) them where they are, with no staging copy. A key's object is byte for byte the
object a staging buffer of the same ``layout`` holds; neighbouring spans merge where memory
runs on inside one region, never across two. A padding row (``-1``), and the rows of a key
whose page names a row outside the cache, read zeros (put) or land in a discard row (get).
The regions to register are :meth:`InPlaceRows.regions`. See ``docs/API.md``, "The
in-place path".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmove.checks import (
    as_index_tensor,
    check_keys,
    check_layout,
    check_positive_int,
    check_range,
    check_valid_tokens,
    has_repeats,
)
from kvmove.memory.cache import KVCache
from kvmove.memory.host_memory import HostMemory
from kvmove.memory.staging import LAYOUTS
from kvmove.objects.descriptors import Descriptors

__all__ = ["DEVICE_TRANSPORTS", "InPlaceRows", "rows_reachable"]

# One-token pages: each slot's span lists are made once when the cache has at most this many
# rows (slots x layers), so that a call only picks them (no tolist() of the addresses).
SLOT_TABLE_ROWS = 1 << 19

# Mooncake transports that read and write device memory directly (GPUDirect RDMA; not
# verified here: this machine has no GPU).
DEVICE_TRANSPORTS = ("rdma",)


class InPlaceRows:
    """The pages of ``kv`` (``page_tokens`` token slots each) as store objects of ``layout``,
    described in place. ``describe`` validates its arguments; the mover, which validated
    them at its own entry, calls ``describe_trusted``.

    >>> rows = InPlaceRows(kv, page_tokens=16)
    >>> store.register(rows)                     # the KV memory, once
    >>> store.put(rows.describe(token_pages, keys))
    >>> store.get(rows.describe(token_pages, keys, get=True))
    """

    def __init__(self, kv: KVCache, page_tokens: int, layout: str = "layer_first"):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        self.kv = kv
        self.page_tokens = check_positive_int(page_tokens, "page_tokens")
        self.layout = check_layout(layout, LAYOUTS)
        self.num_slots = kv.num_slots
        pool = kv.row_pool
        bases, pitches, rows, storages, extents = [], [], [], [], {}
        per_buffer = []  # (first column, layers) of each buffer
        for name in kv.buffer_names:
            b = pool.buffers[name]
            per_buffer.append((len(bases), b.num_layers))
            for view in b.layers:
                start = view.data_ptr()
                end = start + (b.num_rows - 1) * b.pitch + b.row_bytes
                storage = view.untyped_storage().data_ptr()
                lo, hi = extents.get(storage, (start, end))
                extents[storage] = (min(lo, start), max(hi, end))
                bases.append(start)
                pitches.append(b.pitch)
                rows.append(b.row_bytes)
                storages.append(storage)
        order = list(extents)
        self._kv_regions = [(extents[s][0], extents[s][1] - extents[s][0]) for s in order]
        region = np.array([order.index(s) for s in storages], dtype=np.int64)
        base = np.array(bases, dtype=np.int64)
        pitch = np.array(pitches, dtype=np.int64)
        row = np.array(rows, dtype=np.int64)
        # The spans of a whole page in object order: per span its column (buffer, layer)
        # and the token of the page it carries.
        t = np.arange(page_tokens, dtype=np.int64)
        cols, toks = [], []
        for first, layers in per_buffer:
            c = first + np.arange(layers, dtype=np.int64)
            if layout == "layer_first":  # [layer][token]
                cols.append(np.repeat(c, page_tokens))
                toks.append(np.tile(t, layers))
            else:  # page_first: [token][layer]
                cols.append(np.tile(c, page_tokens))
                toks.append(np.repeat(t, layers))
        col = np.concatenate(cols)
        self._token = np.concatenate(toks)
        self._base = base[col]
        self._pitch = pitch[col]
        self._size = row[col]
        self._region = region[col]
        self._same_region = self._region[1:] == self._region[:-1]
        self._sizes_full = self._size.tolist()
        self.bytes_per_token = int(row.sum())
        # The rows that stand in for padding: zeros to read, a row to write and forget.
        widest = int(row.max())
        self._pad = HostMemory(2 * widest, pin=None)
        self.zero_row = self._pad.address
        self.discard_row = self._pad.address + widest
        self._described_regions = tuple(self.regions())  # every descriptor's (fixed)
        self._slot_ptrs = self._slot_sizes = None
        self._slot_spans = None  # spans per slot in the lists, where every slot has as many
        if page_tokens == 1 and self.num_slots * self._size.size <= SLOT_TABLE_ROWS:
            every = np.arange(self.num_slots, dtype=np.int64)[:, None]
            addr = self._base + every * self._pitch
            if self._touching(addr).any():
                self._slot_ptrs, self._slot_sizes = self._span_lists(
                    addr, None, np.ones(self.num_slots, np.int64))
                counts = set(map(len, self._slot_ptrs))
                if len(counts) == 1:
                    self._slot_spans = counts.pop()
            else:  # no two spans of a slot touch: one size list for every slot
                self._slot_ptrs = addr.tolist()
                self._slot_sizes = [self._sizes_full] * self.num_slots
                self._slot_spans = int(self._size.size)

    # -- memory ---------------------------------------------------------------------------
    def regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the memory the descriptors name: the extent of each
        storage the cache's rows live in, then the zero and discard rows."""
        return [*self._kv_regions, (self._pad.address, self._pad.nbytes)]

    @property
    def kv_regions(self) -> list[tuple[int, int]]:
        """The regions of the KV cache itself (without the padding rows)."""
        return list(self._kv_regions)

    @property
    def spans_per_page(self) -> int:
        """Spans of a whole page before merging (one per row of every layer)."""
        return int(self._size.size)

    # -- descriptors ----------------------------------------------------------------------
    def describe(self, token_pages, keys: Sequence[str], *, valid_tokens=None,
                 get: bool = False) -> Descriptors:
        """Descriptors of the pages ``token_pages`` (``[n, page_tokens]`` int32/int64 KV
        token slots, ``-1`` = padding) stored under ``keys``, for a put (``get=False``) or a
        get into the rows (``get=True``). ``valid_tokens`` (an int or one per key, default
        ``page_tokens``) stores a partial page. Raises ``TypeError`` / ``ValueError`` /
        ``IndexError`` naming the argument and the bad value, before anything is
        described: keys not distinct non-empty str, a shape that is not ``[len(keys),
        page_tokens]``, a slot outside the cache, a destination slot named twice
        (``get=True``)."""
        keys = check_keys(keys)
        n = len(keys)
        pages = as_index_tensor(token_pages, "token_pages", dim=2)
        if tuple(pages.shape) != (n, self.page_tokens) and (n or pages.numel()):
            raise ValueError(f"token_pages has shape {tuple(pages.shape)}; expected "
                             f"[{n}, {self.page_tokens}] (one page of page_tokens per key)")
        check_range(pages, self.num_slots, "token_pages")
        host = pages.numpy().astype(np.int64).reshape(n, self.page_tokens)
        if get:
            kept = host[host >= 0]
            if has_repeats(kept):
                raise ValueError("token_pages names a KV row more than once; the rows a get "
                                 "writes must be distinct")
        valid = check_valid_tokens(valid_tokens, n, self.page_tokens)
        return self.describe_trusted(host, keys, valid, get=get)

    def describe_trusted(self, pages: np.ndarray, keys: list[str], valid: np.ndarray, *,
                         get: bool, bad: np.ndarray | None = None) -> Descriptors:
        """:meth:`describe` of arguments already validated: ``pages`` int64 ``[n,
        page_tokens]`` with every entry ``-1`` or a slot of the cache, except in the pages
        of keys flagged in ``bad`` (bool ``[n]``, get only: their rows go to the discard
        row); ``keys`` distinct non-empty str; ``valid`` int64 ``[n]`` in
        ``1..page_tokens``."""
        n = len(keys)
        nbytes = valid * self.bytes_per_token
        regions = self._described_regions
        if n == 0:
            return Descriptors._trusted([], [], [], nbytes, regions, self)
        if self._slot_ptrs is not None and (bad is None or not bad.any()):
            first = pages[:, 0].tolist()
            if min(first) >= 0:  # one-token pages, no padding: the prepared lists
                spans = self._slot_spans
                return Descriptors._trusted(keys, list(map(self._slot_ptrs.__getitem__, first)),
                                            list(map(self._slot_sizes.__getitem__, first)),
                                            nbytes, regions, self,
                                            num_spans=None if spans is None else n * spans,
                                            total_bytes=n * self.bytes_per_token)
        slots = pages[:, self._token]  # [n, spans]: the KV slot each span carries
        pad = slots < 0
        if bad is not None and bad.any():
            pad |= bad[:, None]
        addr = self._base + slots * self._pitch
        padded = bool(pad.any())
        if padded:
            addr[pad] = self.discard_row if get else self.zero_row
        whole = bool((valid == self.page_tokens).all())
        if whole:
            touch = self._touching(addr)
            if padded:
                touch &= ~pad[:, :-1] & ~pad[:, 1:]
            if not touch.any():  # every span its own: one 2-D list, one shared size list
                return Descriptors._trusted(keys, addr.tolist(), [self._sizes_full] * n,
                                            nbytes, regions, self, num_spans=addr.size,
                                            total_bytes=n * self.page_tokens
                                            * self.bytes_per_token)
        ptrs, sizes = self._span_lists(addr, pad if padded else None, valid)
        return Descriptors._trusted(keys, ptrs, sizes, nbytes, regions, self)

    def _touching(self, addr: np.ndarray) -> np.ndarray:
        """bool ``[n, spans - 1]``: span ``j`` of a key ends where span ``j + 1`` starts, in
        one region."""
        return (addr[:, :-1] + self._size[:-1] == addr[:, 1:]) & self._same_region

    def _span_lists(self, addr: np.ndarray, pad: np.ndarray | None, valid: np.ndarray
                    ) -> tuple[list[list[int]], list[list[int]]]:
        """The general case: per key (row of ``addr``) the spans of its valid tokens,
        neighbours merged where the memory runs on in one region. The spans of all keys are
        laid end to end and merged in one pass; a new span starts at each key's first
        span."""
        n = addr.shape[0]
        kept = self._token[None, :] < valid[:, None]  # [n, spans]
        counts = kept.sum(axis=1)
        a = addr[kept]
        size = np.broadcast_to(self._size, addr.shape)[kept]
        region = np.broadcast_to(self._region, addr.shape)[kept]
        start = np.ones(a.size, dtype=bool)
        start[1:] = (a[:-1] + size[:-1] != a[1:]) | (region[:-1] != region[1:])
        if pad is not None:
            p = pad[kept]
            start[1:] |= p[:-1] | p[1:]
        first = np.zeros(n, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        start[first] = True
        at = np.flatnonzero(start)
        ptrs = a[at].tolist()
        sizes = np.add.reduceat(size, at).tolist()
        ends = np.cumsum(start)[first + counts - 1].tolist()  # merged spans up to each key
        ptr_lists, size_lists, begin = [], [], 0
        for end in ends:
            ptr_lists.append(ptrs[begin:end])
            size_lists.append(sizes[begin:end])
            begin = end
        return ptr_lists, size_lists

    def close(self) -> None:
        """Release the padding rows (the KV memory is the engine's)."""
        self._pad.close()

    def __repr__(self) -> str:
        return (f"InPlaceRows({self.layout}, {self.page_tokens} tokens per page, "
                f"{self.spans_per_page} rows per page, {len(self._kv_regions)} KV region(s) "
                f"on {self.kv.device})")


def rows_reachable(device: torch.device, protocol: str | None) -> str | None:
    """Why a store on ``protocol`` cannot read and write KV rows on ``device`` in place, or
    ``None`` when it can: host memory over any transport; device memory only over a
    transport that reads it (GPUDirect RDMA), never over TCP, which copies through host
    buffers it owns."""
    if device.type == "cpu":
        return None
    if protocol in DEVICE_TRANSPORTS:
        return None
    return (f"the KV cache is in {device} memory and the store's transport "
            f"({protocol or 'unknown'}) does not read device memory; only "
            f"{', '.join(DEVICE_TRANSPORTS)} does (GPUDirect)")
