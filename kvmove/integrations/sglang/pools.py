"""kvmove's view of SGLang's host pools: which (pool, layout) combinations it serves (the
objects SGLang's own Mooncake backend stores), and the :class:`kvmove.HostPool` of each:
MLA ``kv_buffer`` in ``layer_first`` ``[L, size, 1, dim]``, ``page_first`` ``[size, L, 1,
dim]`` or ``page_first_direct`` ``[pages, L, page, 1, dim]``, one object per page; MHA
``[2, ...]`` and asymmetric MHA (a ``(k_buffer, v_buffer)`` pair) in ``page_first`` or
``page_first_direct``, two objects per page, k then v (MHA ``layer_first`` interleaves them
per layer: refused, as SGLang does); the DSA indexer pool ``[pages, L, 1, page_bytes]``,
one object per page. Anything else is a ``ValueError`` naming it, when the pool registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvmove.checks import page_numbers
from kvmove.memory.host_pool import HostPool

MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MHA_LAYOUTS = ("page_first", "page_first_direct")
INDEXER_LAYOUTS = ("page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolView:
    """The host pools of one SGLang pool's objects (one per object of a page), and how its
    token indices map to pages."""

    components: tuple[HostPool, ...]
    page_size: int  # SGLang's tokens per page
    kind: str  # "mla", "mha" or "indexer", for messages

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
        return PoolView((HostPool({"kv": buffer}, page_tokens=page, layout=layout),), page,
                        "MLA")
    if layout not in MHA_LAYOUTS:
        raise _unsupported(kind, layout, MHA_LAYOUTS)
    if isinstance(buffer, (tuple, list)):
        return _split_kv_view(pool, buffer, layout, page)
    if buffer.dim() < 5 or buffer.shape[0] != 2:
        raise ValueError(f"MHA host pool kv_buffer has shape {tuple(buffer.shape)}, expected "
                         f"[2, ...] (k and v); is the storage config's is_mla_model right?")
    return PoolView((HostPool({"k": buffer[0]}, page_tokens=page, layout=layout),
                     HostPool({"v": buffer[1]}, page_tokens=page, layout=layout)), page, "MHA")


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
        view = PoolView((HostPool({"k": k}, page_tokens=page, layout=layout),
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
    return PoolView((host,), int(pool.page_size), "DSA indexer")
