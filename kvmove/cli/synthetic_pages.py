"""The bytes of the demos' synthetic pages: a function of the page number and the buffer
only, so that any process can check what another wrote without being told the bytes."""

from __future__ import annotations

import zlib

# DSA-like row sizes: FP8 MLA (512 B fp8 nope + 64 bf16 rope + 16 B scales) and the fp8
# indexer key with its fp32 scale.
ROWS = {"kv": 656, "indexer": 132}


def page_bytes(page: int, name: str, layers: int, tokens: int, row: int):
    """The bytes page ``page`` of buffer ``name`` holds: a uint8 tensor ``[layers, tokens,
    row]`` (torch is imported here, not with the module: the nodes start without it)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{page}".encode()))
    return torch.randint(0, 256, (layers, tokens, row), dtype=torch.uint8, generator=g)
