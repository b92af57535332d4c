"""The bytes of the demos' synthetic pages: a function of the page number and the buffer
only, so that any process can check what another wrote without being told the bytes."""

from __future__ import annotations

import zlib

import torch


def page_bytes(page: int, name: str, layers: int, tokens: int, row: int) -> torch.Tensor:
    """The bytes page ``page`` of buffer ``name`` holds: ``[layers, tokens, row]``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{page}".encode()))
    return torch.randint(0, 256, (layers, tokens, row), dtype=torch.uint8, generator=g)
