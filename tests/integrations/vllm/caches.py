"""KV caches laid out as vLLM lays them out: per layer a logical ``[num_blocks, H, N, C]``
view of one storage, in a given physical order (vLLM's ``KVCacheLayout`` names)."""

from __future__ import annotations

import torch

# Physical order of the logical axes (L, B, H, N, C), outermost first.
LAYOUTS = {
    "LBHNC": "LBHNC",
    "LBNHC": "LBNHC",
    "LHBNC": "LHBNC",
    "BLHNC": "BLHNC",
    "BLNHC": "BLNHC",
}


def vllm_layer_caches(layout: str, layers: int, blocks: int, heads: int, block_size: int,
                      head_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    """``layers`` views ``[blocks, heads, block_size, head_bytes // 2]`` (bf16) into one
    storage filled with seeded random bytes, in the physical order ``layout``."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": head_bytes // 2}
    physical = torch.empty([sizes[a] for a in layout], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    physical.view(torch.uint8).copy_(
        torch.randint(0, 256, physical.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    logical = physical.permute([layout.index(a) for a in "LBHNC"])
    return [logical[i] for i in range(layers)]


def mla_layer_caches(layers: int, blocks: int, block_size: int, entry_bytes: int,
                     seed: int = 0) -> list[torch.Tensor]:
    """MLA: per layer ``[blocks, 1, block_size, entry_bytes // 2]`` in one storage."""
    return vllm_layer_caches("LBHNC", layers, blocks, 1, block_size, entry_bytes, seed)
