"""Staging buffers of named geometries filled with random bytes, and the canonical object
bytes of a page computed straight from the staging tensors (independently of describe)."""

from __future__ import annotations

import ctypes

import torch

import kvmove

# name -> {buffer: (layers, row_bytes)}
GEOMETRIES = {
    "mla": {"kv": (4, 656)},  # one buffer, DSA FP8 MLA rows
    "mha": {"k": (3, 256), "v": (3, 256)},  # k and v in one object
    "hybrid": {"kv": (4, 656), "indexer": (2, 132)},  # different layer counts and rows
}


def make_staging(geometry: dict, *, num_slots: int, page_tokens: int, seed: int = 0,
                 layout: str = "layer_first"):
    """A StagingBuffer of ``geometry`` (in ``layout``) whose every byte is random."""
    kv = kvmove.KVCache({
        name: torch.zeros(layers, 8, row_bytes, dtype=torch.uint8)
        for name, (layers, row_bytes) in geometry.items()
    })
    staging = kvmove.StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens,
                                   layout=layout)
    g = torch.Generator().manual_seed(seed)
    for name in staging.buffer_names:
        t = staging.tensor(name)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return staging


def canonical(staging, slot: int, valid_tokens: int) -> bytes:
    """The object bytes of the page in ``slot``: for each buffer in declaration order, for
    each layer ascending, the first ``valid_tokens`` rows (of a page-first staging: token
    by token, every layer's row of a token side by side)."""
    parts = []
    for name in staging.buffer_names:
        n = valid_tokens * staging.row_bytes(name)
        t = staging.tensor(name)
        if staging.layout == "page_first":  # [slots, page_tokens, L, row_bytes]
            parts.append(t[slot, :valid_tokens].numpy().tobytes())
            continue
        parts.extend(t[layer, slot, :n].numpy().tobytes() for layer in range(t.shape[0]))
    return b"".join(parts)


def span_bytes(desc, i: int) -> bytes:
    """The bytes key ``i``'s spans point at, concatenated in order."""
    return b"".join(
        ctypes.string_at(p, s) for p, s in zip(desc.ptrs[i], desc.sizes[i], strict=True)
    )


def page(staging, slot: int) -> dict[str, torch.Tensor]:
    """A copy of every byte of one staging slot, per buffer ``[L, page_bytes]``."""
    return {n: staging.tensor(n)[:, slot].clone() for n in staging.buffer_names}


def spans_crossing(spans, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` spans that do not lie inside a single one of ``ranges``
    (registered host memory): a copy or store span must never cross a registration."""
    return [(a, n) for a, n in spans
            if not any(r <= a and a + n <= r + size for r, size in ranges)]
