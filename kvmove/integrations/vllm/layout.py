"""vLLM's KV cache as a kvmove row pool: one vLLM block is one kvmove row.

vLLM's ``RankLocalStoreLayout`` cuts the KV cache into *regions*: per layer tensor (in the
order vLLM hands them over) either the whole storage (when one block's bytes of every layer
sharing it are one run: block-outermost layouts), or the layer's own blocks (``LBHNC``,
``LBNHC``, MLA), or, where a block of one layer is not dense (head-outermost ``LHBNC``), one
region per head. A block's object is, region by region, ``block_len`` bytes at
``region + block_id * block_len``. :func:`block_regions` rebuilds exactly those regions as
``uint8 [num_blocks, block_len]`` views, so kvmove's canonical object (layers ascending, a
page's rows) is vLLM's object byte for byte. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one contiguous run in some order of its dimensions."""
    if t.numel() <= 1:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _blocks_first(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A kernel-block-granular cache with vLLM's (manager) blocks as dim 0."""
    if cache.shape[0] == num_blocks:
        return cache
    if cache.shape[0] % num_blocks:
        raise ValueError(f"a KV cache tensor has {cache.shape[0]} blocks, not a multiple of "
                         f"vLLM's {num_blocks}")
    return cache.unflatten(0, (num_blocks, -1))


@dataclass(frozen=True)
class Region:
    """``block_len`` bytes per block at ``address + block_id * block_len``."""

    address: int
    block_len: int
    layer_name: str  # the first vLLM layer whose tensor gave this region


def regions_of(named_caches: Sequence[tuple[str, torch.Tensor]], num_blocks: int) -> list[Region]:
    """vLLM's ``RankLocalStoreLayout.register_kv_caches`` regions, in its order."""
    seen: set[int] = set()
    regions: list[Region] = []

    def add(address: int, block_len: int, name: str) -> None:
        if address not in seen:
            seen.add(address)
            regions.append(Region(address, block_len, name))

    for name, raw in named_caches:
        cache = _blocks_first(raw, num_blocks)
        storage = cache.untyped_storage()
        size = cache.element_size()
        if not _dense(cache[0]):
            for head in range(cache.shape[1]):
                head_cache = cache[:, head]
                if not _dense(head_cache[0]):
                    raise ValueError(f"layer {name!r}: one head's block is not dense "
                                     f"(shape {tuple(cache.shape)}, stride {cache.stride()})")
                add(head_cache.data_ptr(), head_cache.stride(0) * size, name)
        elif cache.stride(0) * size * num_blocks == storage.nbytes():
            add(storage.data_ptr(), storage.nbytes() // num_blocks, name)
        else:
            add(cache.data_ptr(), cache.stride(0) * size, name)
    return regions


def block_regions(named_caches: Sequence[tuple[str, torch.Tensor]],
                  num_blocks: int) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The regions as ``uint8 [num_blocks, block_len]`` views into vLLM's KV cache, and for
    each vLLM layer the last region index its bytes are in (what a layer-wise load waits
    for). Raises ``ValueError`` for a layout whose regions kvmove cannot express (regions
    of different sizes, or reaching past their storage)."""
    regions = regions_of(named_caches, num_blocks)
    if not regions:
        raise ValueError("no KV cache tensors to register")
    lens = {r.block_len for r in regions}
    if len(lens) != 1:
        raise ValueError(f"KV cache regions of different block sizes {sorted(lens)}: a layout "
                         f"kvmove does not cover (one object format per store)")
    views = []
    storages = {}
    for _, raw in named_caches:
        st = raw.untyped_storage()
        storages[st.data_ptr()] = (st, raw.device)
    for r in regions:
        base = max((a for a in storages if a <= r.address), default=None)
        if base is None:
            raise ValueError(f"region at {r.address:#x} lies outside the KV cache storage")
        storage, device = storages[base]
        offset = r.address - base
        if offset + num_blocks * r.block_len > storage.nbytes():
            raise ValueError(
                f"layer {r.layer_name!r}: {num_blocks} blocks of {r.block_len} bytes at offset "
                f"{offset} reach past the tensor's storage ({storage.nbytes()} bytes); kvmove "
                f"does not cover this KV cache layout"
            )
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        views.append(flat.as_strided((num_blocks, r.block_len), (r.block_len, 1), offset))
    last_region: dict[str, int] = {}
    for name, raw in named_caches:
        cache = _blocks_first(raw, num_blocks)
        inside = [i for i, r in enumerate(regions)
                  if r.address <= cache.data_ptr() < r.address + r.block_len * num_blocks
                  or r.layer_name == name]
        last_region[name] = max(inside) if inside else len(regions) - 1
    return views, last_region
