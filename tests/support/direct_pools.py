"""Host pools with guard bands and the bytes a direct send must leave in them, for the
``kvmove.direct`` tests: a pool's buffers are views into the middle of larger uint8 arrays
whose guard bytes must never change, and :func:`apply_send` is the reference of what a
send writes (row by row, nothing clever)."""

from __future__ import annotations

import numpy as np
import torch

import kvmove

GUARD = 4096  # bytes before and after each buffer
GUARD_BYTE = 0xAA
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def pool_shape(layout: str, layers: int, row: int, pages: int, page_tokens: int,
               extra_tokens: int = 0) -> tuple[int, ...]:
    """A pool tensor's shape: ``[L, tokens, row]``, ``[tokens, L, row]`` or ``[pages, L,
    page_tokens, row]`` (``extra_tokens`` after the whole pages, not for the last)."""
    tokens = pages * page_tokens + extra_tokens
    return {"layer_first": (layers, tokens, row), "page_first": (tokens, layers, row),
            "page_first_direct": (pages, layers, page_tokens, row)}[layout]


def guarded(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(whole, view)``: ``whole`` is guard, pool, guard (pool bytes random from ``seed``),
    ``view`` the pool part in ``shape``."""
    n = int(np.prod(shape))
    whole = torch.full((GUARD + n + GUARD,), GUARD_BYTE, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    whole[GUARD:GUARD + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return whole, whole[GUARD:GUARD + n].view(shape)


def make_pool(spec: dict, seed: int) -> tuple[kvmove.HostPool, dict[str, torch.Tensor],
                                              dict[str, torch.Tensor]]:
    """``spec``: ``{"layout", "page_tokens", "pages", "buffers": {name: [layers, row]},
    "extra_tokens"?}``. Returns the pool, the guarded arrays and the pool views."""
    wholes, views = {}, {}
    for i, (name, (layers, row)) in enumerate(spec["buffers"].items()):
        shape = pool_shape(spec["layout"], layers, row, spec["pages"], spec["page_tokens"],
                           spec.get("extra_tokens", 0))
        wholes[name], views[name] = guarded(shape, seed * 101 + i)
    pool = kvmove.HostPool(views, page_tokens=spec["page_tokens"], layout=spec["layout"])
    return pool, wholes, views


def kv_layers(buffers: dict, slots: int, seed: int) -> dict[str, torch.Tensor]:
    """A sender's KV: per buffer ``[L, slots, row]`` random bytes."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, 256, (layers, slots, row), dtype=torch.uint8, generator=g)
            for name, (layers, row) in buffers.items()}


def pool_row(view: torch.Tensor, layout: str, layer: int, page: int, token: int,
             page_tokens: int) -> torch.Tensor:
    if layout == "layer_first":
        return view[layer, page * page_tokens + token]
    if layout == "page_first":
        return view[page * page_tokens + token, layer]
    return view[page, layer, token]


def apply_send(views: dict[str, torch.Tensor], kv: dict[str, torch.Tensor], layout: str,
               page_tokens: int, token_pages, dst_pages, layers=None, ok=None) -> None:
    """Write into ``views`` what a send of ``token_pages`` -> ``dst_pages`` writes: for
    every page (whose ``ok`` is true), every layer of every buffer (or layer ``layers``
    of those that have it), the rows before the first ``-1``."""
    tp = torch.as_tensor(token_pages).tolist()
    for i, (rows, page) in enumerate(zip(tp, list(dst_pages), strict=True)):
        if ok is not None and not ok[i]:
            continue
        valid = rows.index(-1) if -1 in rows else len(rows)
        for name, src in kv.items():
            chosen = range(src.shape[0]) if layers is None else (
                [layers] if layers < src.shape[0] else [])
            for layer in chosen:
                for t in range(valid):
                    pool_row(views[name], layout, layer, int(page), t, page_tokens)[:] = \
                        src[layer, rows[t]].reshape(-1)
