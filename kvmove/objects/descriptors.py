"""Per-key multi-buffer descriptors of staging slots (layer-first or page-first).

One store key is one page; its object is the canonical object of ``docs/API.md``
("Descriptors"). In a layer-first staging ``[L, num_slots, page_tokens * row_bytes]`` that
is one span per (buffer, layer), of ``valid_tokens * row_bytes`` bytes; in a page-first
staging ``[num_slots, page_tokens, L, row_bytes]`` one span per buffer of ``valid_tokens *
L * row_bytes`` bytes. Spans that touch inside one buffer merge; spans of different buffers
never do (each buffer is its own registered region). No Python loop over (page, layer).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvmove.checks import as_int_array, check_keys, check_valid_tokens
from kvmove.objects.span_check import first_outside

__all__ = ["Descriptors", "concat", "describe", "describe_trusted"]

# A few spans are worked out in Python ints: numpy's fixed cost per call is more than the
# arithmetic. Up to this many spans in a batch of one-span keys (64 one-span keys: 10.7 µs
# against 13.1 µs by numpy), and of keys of several spans up to SMALL_KEYS keys (one list
# per key costs more in Python: 16 keys of 2 spans 6.1 µs against 5.7 µs, 32 keys 10.3
# against 6.6 µs; 1 key of 61 spans 5.5 against 7.1 µs).
SMALL_SPANS = 64
SMALL_KEYS = 8


class Descriptors:
    """Multi-buffer descriptors of a batch of keys, in Mooncake's
    ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` form.

    - ``keys[i]``: the store key of object ``i``;
    - ``ptrs[i]`` / ``sizes[i]``: the addresses and byte counts of its spans, in object
      order (Mooncake concatenates them into one object on put and splits the object over
      them on get);
    - ``nbytes(i)``: the object size, ``sum(sizes[i])``; ``total_bytes``: of all keys;
    - ``regions``: the ``(address, nbytes)`` memory regions the spans live in, and
      ``staging``: the staging buffer they belong to (``None`` when built from lists), so
      that a store can register that memory, and forget it when the staging is gone;
    - ``vouched``: kvmove worked the spans out (:func:`describe`, in-place rows); a store
      takes a raw one's spans only inside memory it has registered (else ``ValueError``).

    Treat the lists as read-only: :func:`describe` gives keys of the same page length one
    shared ``sizes`` list (``desc.sizes[0] is desc.sizes[1]``). Build one with
    :func:`describe`, or directly from lists (which validates them).
    """

    __slots__ = ("_nbytes", "_spans", "_total", "keys", "ptrs", "regions", "sizes", "staging",
                 "vouched")

    keys: list[str]
    ptrs: list[list[int]]
    sizes: list[list[int]]
    regions: tuple[tuple[int, int], ...]

    def __init__(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        *,
        regions: Sequence[tuple[int, int]] = (),
    ):
        keys = check_keys(keys)
        if len(ptrs) != len(keys) or len(sizes) != len(keys):
            raise ValueError(
                f"ptrs ({len(ptrs)}) and sizes ({len(sizes)}) must have one entry per key "
                f"({len(keys)} keys)"
            )
        ptrs = [[int(p) for p in row] for row in ptrs]
        sizes = [[int(s) for s in row] for row in sizes]
        for i, (p, s) in enumerate(zip(ptrs, sizes, strict=True)):
            if not p or len(p) != len(s):
                raise ValueError(
                    f"key {keys[i]!r}: ptrs[{i}] has {len(p)} spans and sizes[{i}] has "
                    f"{len(s)}; they must be equal and non-zero"
                )
            if min(s) <= 0:
                raise ValueError(f"key {keys[i]!r}: span sizes must be positive, got {s}")
            if min(p) <= 0:
                raise ValueError(f"key {keys[i]!r}: span addresses must be positive, got {p}")
        self.keys, self.ptrs, self.sizes = keys, ptrs, sizes
        self._nbytes = np.array([sum(s) for s in sizes], dtype=np.int64)
        self._spans = self._total = None
        self.regions = tuple((int(a), int(n)) for a, n in regions)
        self.staging = None
        self.vouched = False  # raw addresses: a store checks them against its regions

    @classmethod
    def _trusted(cls, keys, ptrs, sizes, nbytes: np.ndarray, regions, staging, *,
                 num_spans: int | None = None, total_bytes: int | None = None,
                 vouched: bool = True) -> Descriptors:
        """Wrap lists that :func:`describe` (or a slice) already validated; ``num_spans``
        and ``total_bytes`` where the caller knows them without a pass over the lists;
        ``vouched``: its spans were worked out from memory kvmove holds."""
        self = object.__new__(cls)
        self.keys, self.ptrs, self.sizes = keys, ptrs, sizes
        self._nbytes = nbytes
        # else worked out on first use (the lists are read-only)
        self._spans, self._total = num_spans, total_bytes
        self.regions = regions
        self.staging = staging
        self.vouched = vouched
        return self

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self, i: int) -> int:
        """The object size of key ``i`` in bytes (the sum of its span sizes)."""
        return int(self._nbytes[i])

    @property
    def total_bytes(self) -> int:
        """The bytes of all objects together."""
        if self._total is None:
            self._total = int(self._nbytes.sum())
        return self._total

    @property
    def num_spans(self) -> int:
        """The number of spans of all keys together (Mooncake's per-span cost)."""
        if self._spans is None:
            self._spans = sum(map(len, self.ptrs))
        return self._spans

    def object_sizes(self) -> list[int]:
        """``nbytes(i)`` of every key, as a list."""
        return self._nbytes.tolist()

    def __getitem__(self, index: slice) -> Descriptors:
        """The descriptors of a contiguous range of keys (``desc[a:b]``)."""
        if not isinstance(index, slice):
            raise TypeError(f"Descriptors index must be a slice, got {type(index).__name__}")
        if index.indices(len(self.keys)) == (0, len(self.keys), 1):  # all of it: itself
            return self
        return Descriptors._trusted(
            self.keys[index], self.ptrs[index], self.sizes[index], self._nbytes[index],
            self.regions, self.staging, vouched=self.vouched,
        )

    def select(self, indices: Sequence[int]) -> Descriptors:
        """The descriptors of keys ``indices`` (in that order)."""
        idx = list(indices)
        return Descriptors._trusted(
            [self.keys[i] for i in idx],
            [self.ptrs[i] for i in idx],
            [self.sizes[i] for i in idx],
            self._nbytes[np.asarray(idx, dtype=np.int64)] if idx else self._nbytes[:0],
            self.regions, self.staging, vouched=self.vouched,
        )

    def with_trailer(self, addresses: Sequence[int], nbytes: int) -> Descriptors:
        """The same objects, each followed by one more span of ``nbytes`` at
        ``addresses[i]`` (e.g. a per-slot checksum). Vouched for only when ``self`` is and
        every trailer lies inside ``self.regions``."""
        if len(addresses) != len(self) or nbytes <= 0:
            raise ValueError(f"need one trailer address per key ({len(self)}) and nbytes > 0, "
                             f"got {len(addresses)} addresses and nbytes={nbytes}")
        inside = self.vouched and first_outside(
            [int(a) for a in addresses], [int(nbytes)] * len(self), self.regions) is None
        return self._with_trailer(addresses, nbytes, vouched=inside)

    def _with_trailer(self, addresses: Sequence[int], nbytes: int, *, vouched: bool = True
                      ) -> Descriptors:
        """:meth:`with_trailer` of trailers kvmove placed (no check of them)."""
        ptrs = [[*p, a] for p, a in zip(self.ptrs, addresses, strict=True)]
        sizes = [[*s, nbytes] for s in self.sizes]
        return Descriptors._trusted(self.keys, ptrs, sizes, self._nbytes + nbytes,
                                    self.regions, self.staging,
                                    vouched=vouched and self.vouched)

    def __iter__(self) -> Iterator[tuple[str, list[int], list[int]]]:
        """``(key, ptrs, sizes)`` of each key."""
        return iter(zip(self.keys, self.ptrs, self.sizes, strict=True))

    def __repr__(self) -> str:
        return (
            f"Descriptors({len(self)} keys, {self.num_spans} spans, "
            f"{self.total_bytes / 2**20:.2f} MiB)"
        )


# -- the span table ---------------------------------------------------------------------------


class _Columns:
    """Per span column (canonical order): the address of slot 0, the slot pitch, the bytes
    per token of the span and the buffer index. Layer-first memory (``tensor(name)`` is
    ``[L, num_slots, page_bytes]``, any strides with contiguous pages) has one column per
    (buffer, layer); page-first memory (``layout == "page_first"``, ``tensor(name)`` is
    ``[num_slots, page_tokens, L, row_bytes]``, contiguous slots) one column per buffer, of
    ``L * row_bytes`` bytes per token."""

    def __init__(self, staging):
        offs, pitches, rows, bufs = [], [], [], []
        page_tokens, num_slots = staging.page_tokens, staging.num_slots
        page_first = getattr(staging, "layout", "layer_first") == "page_first"
        for b, name in enumerate(staging.buffer_names):
            t = staging.tensor(name)
            layers, row_bytes = staging.num_layers(name), staging.row_bytes(name)
            if page_first:
                shape = (num_slots, page_tokens, layers, row_bytes)
                token_bytes = layers * row_bytes
                if t.dtype != torch.uint8 or tuple(t.shape) != shape or (
                        not t[0].is_contiguous()):
                    raise ValueError(
                        f"staging buffer {name!r}: expected a uint8 tensor of shape {shape} "
                        f"with contiguous slots, got {t.dtype} {tuple(t.shape)} stride "
                        f"{t.stride()}"
                    )
                offs.append(np.array([t.data_ptr()], dtype=np.int64))
                pitches.append(np.array([t.stride(0)], dtype=np.int64))
                rows.append(np.array([token_bytes], dtype=np.int64))
                bufs.append(np.array([b], dtype=np.int64))
                continue
            shape = (layers, num_slots, page_tokens * row_bytes)
            if t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(2) != 1:
                raise ValueError(
                    f"staging buffer {name!r}: expected a uint8 tensor of shape {shape} with "
                    f"contiguous pages, got {t.dtype} {tuple(t.shape)} stride {t.stride()}"
                )
            offs.append(t.data_ptr() + np.arange(layers, dtype=np.int64) * t.stride(0))
            pitches.append(np.full(layers, t.stride(1), dtype=np.int64))
            rows.append(np.full(layers, row_bytes, dtype=np.int64))
            bufs.append(np.full(layers, b, dtype=np.int64))
        self.offset = np.concatenate(offs)
        self.slot_pitch = np.concatenate(pitches)
        self.row_bytes = np.concatenate(rows)
        self.buffer = np.concatenate(bufs)
        self.same_buffer = self.buffer[:-1] == self.buffer[1:]
        self.bytes_per_token = int(self.row_bytes.sum())
        pitch = self.slot_pitch
        self.uniform_pitch = int(pitch[0]) if bool((pitch == pitch[0]).all()) else None
        self.where: tuple[int, ...] = ()
        self.fixed = False  # the staging's tensors never change (its ``fixed_memory``)
        # The memory regions the spans live in (to register them), as the staging says.
        self.regions = tuple(staging.regions()) if hasattr(staging, "regions") else ()
        self._starts: dict[int, np.ndarray | None] = {}
        self._sizes: dict[int, list[int]] = {}
        self._few: dict[int, _FewSpans] = {}

    def addresses(self, slot_ids: np.ndarray) -> np.ndarray:
        """int64 ``[n, spans]``: the address of every span of the pages in ``slot_ids``."""
        if self.uniform_pitch is not None:  # one buffer, or buffers of one page size
            return np.add.outer(slot_ids * self.uniform_pitch, self.offset)
        ptrs = np.multiply.outer(slot_ids, self.slot_pitch)
        ptrs += self.offset
        return ptrs

    def few(self, valid_tokens: int) -> _FewSpans:
        """What :func:`describe_trusted` needs for a few keys of ``valid_tokens`` each, in
        Python ints (made once per page length)."""
        few = self._few.get(valid_tokens)
        if few is None:
            start = self.starts(valid_tokens)
            cols = slice(None) if start is None else start
            few = self._few[valid_tokens] = _FewSpans(
                list(zip(self.offset[cols].tolist(), self.slot_pitch[cols].tolist(),
                         strict=True)),
                self.sizes(valid_tokens), valid_tokens * self.bytes_per_token)
        return few

    def starts(self, valid_tokens: int) -> np.ndarray | None:
        """Columns that start a merged span for keys with ``valid_tokens``, or ``None``
        when no two spans touch. Within one buffer the slot terms of two spans' addresses
        are equal, so whether span j ends where span j+1 starts does not depend on the
        slot."""
        if valid_tokens not in self._starts:
            touch = self.same_buffer & (
                self.offset[:-1] + valid_tokens * self.row_bytes[:-1] == self.offset[1:]
            )
            self._starts[valid_tokens] = (
                np.flatnonzero(np.concatenate(([True], ~touch))) if touch.any() else None
            )
        return self._starts[valid_tokens]

    def sizes(self, valid_tokens: int) -> list[int]:
        """The span sizes of a key with ``valid_tokens``, merged spans merged (one list for
        every such key: read-only)."""
        sizes = self._sizes.get(valid_tokens)
        if sizes is None:
            size, start = valid_tokens * self.row_bytes, self.starts(valid_tokens)
            sizes = (size if start is None else np.add.reduceat(size, start)).tolist()
            self._sizes[valid_tokens] = sizes
        return sizes


class _FewSpans:
    """The spans of a key of one page length, for describing a few keys in Python ints:
    ``(offset, slot pitch)`` of each (merged) span, the sizes list every key shares, and
    the object sizes of ``n`` keys (int64 ``[n]``, read-only, made once per ``n``)."""

    __slots__ = ("_object_sizes", "columns", "key_bytes", "sizes")

    def __init__(self, columns: list[tuple[int, int]], sizes: list[int], key_bytes: int):
        self.columns, self.sizes, self.key_bytes = columns, sizes, key_bytes
        self._object_sizes: dict[int, np.ndarray] = {}

    def fits(self, n: int) -> bool:
        """Whether ``n`` keys are few enough for Python ints (see :data:`SMALL_SPANS`)."""
        spans = len(self.columns)
        return n * spans <= SMALL_SPANS and (spans == 1 or n <= SMALL_KEYS)

    def addresses(self, slots: list[int]) -> list[list[int]]:
        if len(self.columns) == 1:
            (offset, pitch), = self.columns
            return [[offset + s * pitch] for s in slots]
        return [[offset + s * pitch for offset, pitch in self.columns] for s in slots]

    def object_sizes(self, n: int) -> np.ndarray:
        sizes = self._object_sizes.get(n)
        if sizes is None:
            sizes = np.full(n, self.key_bytes, dtype=np.int64)
            sizes.flags.writeable = False
            self._object_sizes[n] = sizes
        return sizes


_COLUMNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _columns(staging) -> _Columns:
    """The span columns of ``staging``, cached while its tensors stay where they are (for
    good, where the staging says its tensors never change: ``fixed_memory``)."""
    try:
        cached = _COLUMNS.get(staging)
    except TypeError:  # not weak-referenceable: no cache
        return _Columns(staging)
    if cached is not None and cached.fixed:
        return cached
    where = tuple(staging.tensor(name).data_ptr() for name in staging.buffer_names)
    if cached is None or cached.where != where:
        cached = _Columns(staging)
        cached.where = where
        cached.fixed = getattr(staging, "fixed_memory", False) is True
        _COLUMNS[staging] = cached
    return cached


def describe(staging, slots, keys: Sequence[str], *, valid_tokens=None) -> Descriptors:
    """Descriptors of the pages in staging ``slots``, one store object per key.

    ``staging``: a :class:`kvmove.StagingBuffer` (anything with its geometry attributes and
    ``tensor(name)``). ``slots``: one staging slot per key (int tensor, array or list); a
    slot may repeat (one page under two keys), though a get into a repeated slot keeps
    whichever object lands last.
    ``keys``: distinct, non-empty ``str``. ``valid_tokens``: ``None`` (whole pages), an int,
    or one int per key, each in ``1..page_tokens``; a partial page stores its first
    ``valid_tokens`` rows of every layer.

    Spans are in canonical object order: buffers in declaration order, layers ascending,
    each ``valid_tokens * row_bytes`` bytes; spans that touch in memory inside one buffer
    are merged. A page-first staging (``staging.layout == "page_first"``) gives one span per
    buffer, its tokens in order, every layer's row of a token side by side. Raises
    ``TypeError`` / ``ValueError`` / ``IndexError`` naming the argument and the bad value;
    nothing is described then.
    """
    keys = check_keys(keys)
    n = len(keys)
    slot_ids = _check_slots(slots, n, staging.num_slots)
    vt = (staging.page_tokens if valid_tokens is None
          else check_valid_tokens(valid_tokens, n, staging.page_tokens))
    return describe_trusted(staging, slot_ids, keys, vt)


def describe_trusted(staging, slot_ids: np.ndarray | list[int], keys: list[str],
                     vt: np.ndarray | int) -> Descriptors:
    """:func:`describe` of arguments already validated: ``slot_ids`` int64 ``[n]`` (or a
    list of ints) in range,
    ``vt`` (``valid_tokens``) one int for every key or int64 ``[n]``, each in range, ``keys``
    a list of distinct non-empty str. For callers that validated once at their own entry
    (the mover)."""
    n = len(keys)
    if n == 0:
        regions = tuple(staging.regions()) if hasattr(staging, "regions") else ()
        return Descriptors._trusted([], [], [], np.zeros(0, dtype=np.int64), regions, staging)
    cols = _columns(staging)
    regions = cols.regions
    if not isinstance(vt, np.ndarray) or vt.min() == vt.max():
        # One page length for every key (the common case): one sizes list for all.
        v = int(vt) if not isinstance(vt, np.ndarray) else int(vt[0])
        few = cols.few(v)
        if few.fits(n):  # Python ints cost less than numpy calls
            slots = slot_ids if type(slot_ids) is list else slot_ids.tolist()
            return Descriptors._trusted(keys, few.addresses(slots), [few.sizes] * n,
                                        few.object_sizes(n), regions, staging,
                                        num_spans=n * len(few.sizes),
                                        total_bytes=n * v * cols.bytes_per_token)
        slot_ids = np.asarray(slot_ids, dtype=np.int64)
        start = cols.starts(v)
        ptrs = cols.addresses(slot_ids)
        ptr_lists = (ptrs if start is None else ptrs[:, start]).tolist()
        nbytes = np.full(n, v * cols.bytes_per_token, dtype=np.int64)
        sizes = cols.sizes(v)
        return Descriptors._trusted(keys, ptr_lists, [sizes] * n, nbytes, regions, staging,
                                    num_spans=n * len(sizes),
                                    total_bytes=n * v * cols.bytes_per_token)
    slot_ids = np.asarray(slot_ids, dtype=np.int64)
    nbytes = vt * cols.bytes_per_token
    # The few distinct page lengths (1..page_tokens), and each key's among them (a table
    # of the lengths present, not np.unique: see kvmove.checks.has_repeats)
    present = np.zeros(int(vt.max()) + 1, dtype=bool)
    present[vt] = True
    values = np.flatnonzero(present)
    group_of = (np.cumsum(present) - 1)[vt]
    starts = [cols.starts(int(v)) for v in values]
    ptr_lists = _spans_by_group(cols.addresses(slot_ids), group_of, starts)
    # Keys of one page length share one sizes list (read-only): copying it per key would
    # cost a third of the whole build.
    size_rows = [cols.sizes(int(v)) for v in values]
    sizes = list(map(size_rows.__getitem__, group_of.tolist()))
    return Descriptors._trusted(keys, ptr_lists, sizes, nbytes, regions, staging)


def _spans_by_group(ptrs: np.ndarray, group_of: np.ndarray, starts) -> list[list[int]]:
    """Each key's span addresses, where keys have different page lengths: per distinct page
    length (group) its columns, merged where its spans touch (one ``tolist()`` per group;
    groups are few)."""
    ptr_lists: list = [None] * ptrs.shape[0]
    for g, start in enumerate(starts):
        members = np.flatnonzero(group_of == g)
        rows = ptrs[members] if start is None else ptrs[members][:, start]
        for i, row in zip(members.tolist(), rows.tolist(), strict=True):
            ptr_lists[i] = row
    return ptr_lists


def concat(parts: Sequence[Descriptors]) -> Descriptors:
    """One batch of the keys of every descriptor set in ``parts``, in order (e.g. the
    ``_k`` and the ``_v`` objects of a page batch, described from two pools). Keys must be
    distinct across parts."""
    parts = list(parts)
    for i, d in enumerate(parts):
        if not isinstance(d, Descriptors):
            raise TypeError(f"parts[{i}] must be kvmove.Descriptors, got {type(d).__name__}")
    if len(parts) == 1:
        return parts[0]
    keys = [k for d in parts for k in d.keys]
    if len(set(keys)) != len(keys):
        raise ValueError("concat: keys repeat across the descriptor sets")
    regions = tuple(dict.fromkeys(r for d in parts for r in d.regions))
    nbytes = np.concatenate([np.asarray(d.object_sizes(), dtype=np.int64) for d in parts]) \
        if keys else np.zeros(0, dtype=np.int64)
    return Descriptors._trusted(keys, [p for d in parts for p in d.ptrs],
                                [s for d in parts for s in d.sizes], nbytes, regions, None,
                                vouched=all(d.vouched for d in parts))


def _check_slots(slots, n: int, num_slots: int) -> np.ndarray:
    """``slots`` as int64, one per key, each in ``0 .. num_slots - 1``."""
    arr = as_int_array(slots, "slots")
    if arr.size != n:
        raise ValueError(f"slots has {arr.size} entries for {n} keys; give one slot per key")
    if n and (int(arr.min()) < 0 or int(arr.max()) >= num_slots):
        bad = np.flatnonzero((arr < 0) | (arr >= num_slots))
        i = int(bad[0])
        raise IndexError(
            f"slots[{i}] = {int(arr[i])} is out of range 0..{num_slots - 1} "
            f"({bad.size} slot(s) out of range)"
        )
    return arr
