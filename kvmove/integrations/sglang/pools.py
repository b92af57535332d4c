"""kvmove's view of SGLang's host pools: which (pool, layout) combinations it serves (the
objects SGLang's own Mooncake backend stores), and the :class:`kvmove.HostPool` of each:
MLA ``kv_buffer`` in ``layer_first`` ``[L, size, 1, dim]``, ``page_first`` ``[size, L, 1,
dim]`` or ``page_first_direct`` ``[pages, L, page, 1, dim]``, one object per page; MHA
``[2, ...]`` and asymmetric MHA (a ``(k_buffer, v_buffer)`` pair) in ``page_first`` or
``page_first_direct``, two objects per page, k then v (MHA ``layer_first`` interleaves them
per layer: refused, as SGLang does); the DSA indexer pool ``[pages, L, 1, page_bytes]``,
one object per page. Anything else is a ``ValueError`` naming it, when the pool registers.

Where each object of a page is one contiguous span (every layout but MLA ``layer_first``),
the view carries :class:`PageSpans`: the address of page ``p``'s object is a base plus ``p``
pitches, so a call's descriptors are a few integer products, with none of the general
describe's work per call (that work is a visible part of a one-page get).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvmove.checks import SMALL_ROWS, page_numbers
from kvmove.memory.host_pool import HostPool
from kvmove.objects.descriptors import Descriptors, describe_trusted

MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MHA_LAYOUTS = ("page_first", "page_first_direct")
INDEXER_LAYOUTS = ("page_first", "page_first_direct")


# Object sizes arrays kept per batch size, up to this many pages (read-only, shared).
_NBYTES_CACHED = 1024


@dataclass(frozen=True)
class PageSpans:
    """Where the objects of a page lie when each is one contiguous span of its component:
    object ``c`` of page ``p`` is ``sizes[c][0]`` bytes at ``bases[c] + p * pitches[c]``.
    Made by :func:`page_spans` from :func:`kvmove.objects.descriptors.describe_trusted` of
    the pool's own pages (so both describe the same bytes); its descriptors are the ones
    ``describe_trusted`` (and ``concat``, component after component) gives."""

    bases: tuple[int, ...]
    pitches: tuple[int, ...]
    sizes: tuple[list[int], ...]  # per component, its one span size (a shared list)
    page_size: int  # tokens per page
    num_pages: int
    regions: tuple[tuple[int, int], ...]
    staging: HostPool | None  # the one component, else None (as concat gives)
    _nbytes: dict = field(default_factory=dict, compare=False, repr=False)

    def few_pages(self, host_indices, n: int) -> list[int] | None:
        """The page numbers of ``host_indices`` for ``n`` keys when it is a CPU tensor of
        ``n * page_size`` integer slots, at most ``SMALL_ROWS``, every page starting at a
        page boundary of the pool; else None, and the general check
        (:meth:`PoolView.pages_of`) decides and says what is wrong. In Python ints: fewer
        fixed costs than the general check's (what the tensor holds is checked on its list:
        ints, one dimension)."""
        p = self.page_size
        if (type(host_indices) is not torch.Tensor or not 0 < n * p <= SMALL_ROWS
                or host_indices.numel() != n * p or not host_indices.is_cpu):
            return None
        firsts = host_indices.tolist()
        if type(firsts) is not list:  # a 0-d tensor
            return None
        if p > 1:
            firsts = firsts[::p]
        low, high = min(firsts), max(firsts)
        # ints (not bools, floats or the rows of a 2-d tensor), in the pool
        if type(low) is not int or low < 0 or high >= self.num_pages * p:
            return None
        if p == 1:
            return firsts
        if any(f % p for f in firsts):
            return None
        return [f // p for f in firsts]

    def describe(self, object_keys: list[list[str]], pages) -> Descriptors:
        """The descriptors of every object of ``pages`` (page numbers in the pool: a list of
        ints or an int64 array, checked), component by component; ``object_keys[c]`` names
        component ``c``'s objects (distinct non-empty strings, as :class:`SGLangKeys` makes
        them)."""
        n = len(pages)
        bases, pitches, sizes = self.bases, self.pitches, self.sizes
        if len(bases) == 1:
            keys, base, pitch = object_keys[0], bases[0], pitches[0]
            if type(pages) is list:
                ptrs = [[base + q * pitch] for q in pages]
            else:
                ptrs = (pages * pitch + base).reshape(-1, 1).tolist()
            span_sizes = [sizes[0]] * n
        else:
            keys = [k for ks in object_keys for k in ks]
            if type(pages) is list:
                ptrs = [[b + q * pitch] for b, pitch in zip(bases, pitches, strict=True)
                        for q in pages]
            else:
                ptrs = (np.asarray(pitches, dtype=np.int64)[:, None] * pages
                        + np.asarray(bases, dtype=np.int64)[:, None]).reshape(-1, 1).tolist()
            span_sizes = [s for s in sizes for _ in range(n)]
        nbytes = self._nbytes.get(n)
        if nbytes is None:
            nbytes = np.repeat(np.asarray([s[0] for s in sizes], dtype=np.int64), n)
            nbytes.flags.writeable = False
            if n <= _NBYTES_CACHED:
                self._nbytes[n] = nbytes
        return Descriptors._trusted(keys, ptrs, span_sizes, nbytes, self.regions,
                                    self.staging, num_spans=len(keys),
                                    total_bytes=n * self.page_bytes)

    @property
    def page_bytes(self) -> int:
        """The bytes of one page's objects, all components."""
        return sum(s[0] for s in self.sizes)


def page_spans(components: tuple[HostPool, ...], page_size: int) -> PageSpans | None:
    """The :class:`PageSpans` of ``components`` (one SGLang pool's objects, whose pages are
    ``page_size`` of its token slots each), or None where a page's object is several spans
    of a component (MLA ``layer_first``: one per layer). The base and pitch are read off
    ``describe_trusted`` of the first pages and checked on a few more, the last included."""
    num_pages = components[0].num_slots
    probe = sorted({0, 1, num_pages // 2, num_pages - 1} & set(range(num_pages)))
    keys = [f"probe-{q}" for q in probe]
    bases, pitches, sizes = [], [], []
    for pool in components:
        if pool.num_slots != num_pages:
            return None
        desc = describe_trusted(pool, probe, keys, pool.page_tokens)
        if any(len(p) != 1 for p in desc.ptrs):
            return None
        base = desc.ptrs[0][0]
        pitch = desc.ptrs[1][0] - base if len(probe) > 1 else 0
        if any(p != [base + q * pitch] for q, p in zip(probe, desc.ptrs, strict=True)) or any(
                s != desc.sizes[0] for s in desc.sizes):
            return None
        bases.append(base)
        pitches.append(pitch)
        sizes.append(list(desc.sizes[0]))
    regions = tuple(dict.fromkeys(r for pool in components for r in pool.regions()))
    return PageSpans(tuple(bases), tuple(pitches), tuple(sizes), page_size, num_pages,
                     regions, components[0] if len(components) == 1 else None)


@dataclass(frozen=True)
class PoolView:
    """The host pools of one SGLang pool's objects (one per object of a page), and how its
    token indices map to pages. ``spans``: where each object of a page is one span, their
    addresses (:class:`PageSpans`), else None."""

    components: tuple[HostPool, ...]
    page_size: int  # SGLang's tokens per page
    kind: str  # "mla", "mha" or "indexer", for messages
    spans: PageSpans | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, components: tuple[HostPool, ...], page_size: int, kind: str) -> PoolView:
        """The view of ``components``, with its :class:`PageSpans` where it has them."""
        return cls(components, page_size, kind, page_spans(components, page_size))

    def pages_of(self, host_indices) -> np.ndarray | list[int]:
        """int64 page numbers of SGLang's ``host_indices`` (``n * page_size`` token slots;
        a few come as a list of ints): see :func:`kvmove.checks.page_numbers`."""
        return page_numbers(host_indices, self.page_size, self.components[0].num_slots,
                            "host_indices", few_as_list=True)

    def regions(self) -> list[tuple[int, int]]:
        return [r for c in self.components for r in c.regions()]

    @property
    def page_bytes(self) -> list[int]:
        """Bytes of each object of one page."""
        return [c.object_bytes for c in self.components]


def _unsupported(kind: str, layout: str, served: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"kvmove's SGLang backend does not serve {kind} host pools in layout {layout!r} "
        f"(served: {', '.join(served)}); launch SGLang with --hicache-mem-layout "
        "page_first"
    )


def kv_view(pool, *, is_mla: bool) -> PoolView:
    """The view of SGLang's anchor KV host pool (``register_mem_pool_host``)."""
    layout = getattr(pool, "layout", None)
    kind = "MLA" if is_mla else "MHA"
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None:
        raise ValueError(f"{kind} host pool {type(pool).__name__} has no kv_buffer (a logical "
                         f"anchor pool): kvmove's SGLang backend serves physical KV pools")
    page = int(pool.page_size)
    if is_mla:
        if layout not in MLA_LAYOUTS:
            raise _unsupported(kind, layout, MLA_LAYOUTS)
        if not isinstance(buffer, torch.Tensor) or buffer.dim() not in (4, 5):
            raise ValueError(f"MLA host pool {type(pool).__name__} kv_buffer is "
                             f"{_describe_buffer(buffer)}, expected one [L, size, 1, dim] "
                             f"tensor or its page_first form; is the storage config's "
                             f"is_mla_model right?")
        return PoolView.of((HostPool({"kv": buffer}, page_tokens=page, layout=layout),), page,
                           "MLA")
    if layout not in MHA_LAYOUTS:
        raise _unsupported(kind, layout, MHA_LAYOUTS)
    if isinstance(buffer, (tuple, list)):
        return _split_kv_view(pool, buffer, layout, page)
    if buffer.dim() < 5 or buffer.shape[0] != 2:
        raise ValueError(f"MHA host pool kv_buffer has shape {tuple(buffer.shape)}, expected "
                         f"[2, ...] (k and v); is the storage config's is_mla_model right?")
    return PoolView.of((HostPool({"k": buffer[0]}, page_tokens=page, layout=layout),
                        HostPool({"v": buffer[1]}, page_tokens=page, layout=layout)), page,
                       "MHA")


def _describe_buffer(buffer) -> str:
    if isinstance(buffer, torch.Tensor):
        return f"a tensor of shape {tuple(buffer.shape)}"
    if isinstance(buffer, (tuple, list)):
        return (f"a {type(buffer).__name__} of "
                f"{[tuple(getattr(b, 'shape', ())) or type(b).__name__ for b in buffer]}")
    return type(buffer).__name__


def _split_kv_view(pool, buffers, layout: str, page: int) -> PoolView:
    """K and V in two buffers of their own (SGLang's ``AsymmetricMHATokenToKVPoolHost``:
    ``head_dim != v_head_dim``): the k and v objects of a page, each one contiguous span of
    its buffer (``page_first``: ``[size, L, heads, dim]``, token by token;
    ``page_first_direct``: ``[pages, L, page, heads, dim]``, layer by layer)."""
    name = type(pool).__name__
    lead = 2 if layout == "page_first" else 3  # dims before a row: [size, L] / [pages, L, page]
    if (len(buffers) != 2 or not all(isinstance(b, torch.Tensor) for b in buffers)
            or any(b.dim() < lead + 1 for b in buffers)
            or buffers[0].shape[:lead] != buffers[1].shape[:lead]):
        raise ValueError(f"MHA host pool {name} kv_buffer is {_describe_buffer(buffers)}; "
                         f"kvmove's SGLang backend serves a (k, v) pair only as "
                         f"[size, L, heads, dim] tensors (page_first) or [pages, L, page, "
                         f"heads, dim] (page_first_direct) with the same leading dims; is the "
                         f"storage config's is_mla_model right?")
    k, v = buffers
    try:
        view = PoolView.of((HostPool({"k": k}, page_tokens=page, layout=layout),
                            HostPool({"v": v}, page_tokens=page, layout=layout)), page, "MHA")
    except (ValueError, TypeError) as e:
        raise ValueError(f"kvmove's SGLang backend cannot serve MHA host pool {name} in "
                         f"layout {layout!r} (k {tuple(k.shape)}, v {tuple(v.shape)}): "
                         f"{e}") from None
    return view


def indexer_view(pool) -> PoolView:
    """The view of SGLang's DSA indexer side pool (``register_mem_host_pool_v2``)."""
    layout = getattr(pool, "layout", None)
    if layout not in INDEXER_LAYOUTS:
        raise _unsupported("DSA indexer", layout, INDEXER_LAYOUTS)
    buffer = getattr(pool, "index_k_with_scale_buffer", None)
    if buffer is None or buffer.dim() != 4:
        raise ValueError(f"DSA indexer host pool has no [pages, L, 1, page_bytes] "
                         f"index_k_with_scale_buffer (got {getattr(buffer, 'shape', None)})")
    # One SGLang page is one opaque row per layer: a page_first_direct pool of one-row pages.
    host = HostPool({"indexer": buffer}, page_tokens=1, layout="page_first_direct")
    return PoolView.of((host,), int(pool.page_size), "DSA indexer")
