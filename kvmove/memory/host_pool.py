"""``HostPool``: the pages of a host KV pool that an engine allocated (kvmove did not),
described in place for zero-copy store puts and gets. Per buffer the pool is one tensor:
``"layer_first"`` ``[L, tokens, *row]`` (a page's object is one span per layer, merged
where they touch), ``"page_first"`` ``[tokens, L, *row]`` (one span, ``[token][layer]``) or
``"page_first_direct"`` ``[pages, L, page_tokens, *row]`` (one span, ``[layer][token]``).
Page ``p`` is tokens ``p * page_tokens ..`` up to the next page; a page's object holds its
spans of every buffer, in declaration order. See ``docs/API.md``,
"``kvmove.HostPool(buffers, *, page_tokens, layout)``".
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from kvmove.checks import check_layout, check_positive_int, page_numbers

__all__ = ["HOST_LAYOUTS", "HostPool"]

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _byte_view(name: str, t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` as uint8 with its first ``lead`` dims kept and the rest one row of bytes, which
    must be contiguous."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"buffer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"buffer {name!r}: a host pool lives in host memory, got {t.device}")
    if t.dim() < lead + 1:
        raise ValueError(f"buffer {name!r}: expected at least {lead + 1} dims, got shape "
                         f"{tuple(t.shape)}")
    row = t.flatten(lead) if t.dim() > lead + 1 else t
    if row.data_ptr() != t.data_ptr() or row.stride(-1) != 1 or row.shape[-1] == 0:
        raise ValueError(f"buffer {name!r}: rows must be contiguous inside (shape "
                         f"{tuple(t.shape)}, stride {t.stride()})")
    if t.dtype != torch.uint8:
        row = row.view(torch.uint8)
    return row


class HostPool:
    """Pages of an engine's host pool, described in place (nothing is copied or allocated).

    ``buffers``: name -> tensor in ``layout`` (see the module doc); ``page_tokens``: tokens
    per page. Raises ``ValueError`` / ``TypeError`` naming the buffer and the bad shape,
    stride, device or layout.

    >>> pool = HostPool({"kv": host_kv}, page_tokens=64, layout="page_first")
    >>> desc = kvmove.describe(pool, pages, keys)   # then store.put(desc) / store.get(desc)
    """

    # Its tensors are made once, here, and never replaced: what describes them may cache
    # their addresses.
    fixed_memory = True

    def __init__(self, buffers: Mapping[str, torch.Tensor], *, page_tokens: int,
                 layout: str):
        check_layout(layout, HOST_LAYOUTS)
        check_positive_int(page_tokens, "page_tokens")
        if not isinstance(buffers, Mapping) or not buffers:
            raise ValueError("buffers must be a non-empty mapping name -> tensor")
        self.layout = layout
        self.page_tokens = page_tokens
        self._tensors: dict[str, torch.Tensor] = {}  # the views describe() reads
        self._layers: dict[str, int] = {}
        self._rows: dict[str, int] = {}
        self._regions: list[tuple[int, int]] = []
        pages: dict[str, int] = {}
        for name, t in buffers.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"buffer names must be non-empty strings, got {name!r}")
            view, layers, row_bytes, num_pages = self._view(name, t)
            self._tensors[name], self._layers[name], self._rows[name] = view, layers, row_bytes
            pages[name] = num_pages
            # From the first byte to the last: a pool may be a strided view (the first
            # tokens of each layer, some of the layers), whose spans reach past numel.
            last = sum((size - 1) * stride
                       for size, stride in zip(t.shape, t.stride(), strict=True))
            self._regions.append((t.data_ptr(), (last + 1) * t.element_size()))
        if len(set(pages.values())) != 1:
            raise ValueError(f"buffers must hold the same number of pages, got {pages}")
        self.num_slots = next(iter(pages.values()))
        if self.num_slots == 0:
            raise ValueError(f"buffers hold no whole page of {page_tokens} tokens: {pages}")

    def _view(self, name: str, t: torch.Tensor):
        """(the view :func:`describe` reads, layers, row bytes, whole pages) of ``t``."""
        p = self.page_tokens
        if self.layout == "page_first_direct":
            b = _byte_view(name, t, 3)  # [pages, L, page_tokens, row]
            if b.shape[2] != p:
                raise ValueError(f"buffer {name!r}: page_first_direct dims are [pages, L, "
                                 f"page_tokens={p}, ...], got shape {tuple(t.shape)}")
            pages, layers, _, row_bytes = b.shape
            if b.stride(2) != row_bytes:
                raise ValueError(f"buffer {name!r}: a page's rows must be contiguous")
            view = b.view(pages, layers, p * row_bytes).transpose(0, 1)  # [L, pages, page]
            return view, layers, row_bytes, pages
        b = _byte_view(name, t, 2)
        if self.layout == "layer_first":  # [L, tokens, row]
            layers, tokens, row_bytes = b.shape
            pages = tokens // p
            if b.stride(1) != row_bytes:
                raise ValueError(f"buffer {name!r}: a layer's rows must be contiguous")
            view = b[:, : pages * p].unflatten(1, (pages, p)).flatten(2)
            return view, layers, row_bytes, pages
        tokens, layers, row_bytes = b.shape  # page_first: [tokens, L, row]
        pages = tokens // p
        if not b.is_contiguous():
            raise ValueError(f"buffer {name!r}: a page_first pool must be contiguous "
                             f"(stride {t.stride()})")
        return b[: pages * p].view(pages, p, layers, row_bytes), layers, row_bytes, pages

    # -- the geometry describe() reads ----------------------------------------------------
    @property
    def buffer_names(self) -> list[str]:
        return list(self._tensors)

    def num_layers(self, name: str) -> int:
        return self._layers[name]

    def row_bytes(self, name: str) -> int:
        return self._rows[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The uint8 view of ``name`` that :func:`kvmove.describe` reads: ``[L, pages,
        page_tokens * row_bytes]`` (layer_first, page_first_direct) or ``[pages,
        page_tokens, L, row_bytes]`` (page_first)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r}; buffers are {self.buffer_names}") from None

    def regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each buffer, to register with a store."""
        return list(self._regions)

    @property
    def object_bytes(self) -> int:
        """Bytes of one whole page's object: every layer of every buffer."""
        return sum(self.page_tokens * self._rows[n] * self._layers[n] for n in self._tensors)

    # -- pages ----------------------------------------------------------------------------
    def pages_of(self, token_indices) -> np.ndarray:
        """int64 page numbers of ``token_indices`` (``n * page_tokens`` token slots, page by
        page, as an engine hands them): see :func:`kvmove.checks.page_numbers`."""
        return page_numbers(token_indices, self.page_tokens, self.num_slots, "token_indices")

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {self._layers[n]}x{self._rows[n]}B" for n in self._tensors)
        return (f"HostPool({self.layout}, {self.num_slots} pages x {self.page_tokens} tokens; "
                f"{parts})")
