"""The one abstraction both sides of every copy share: a row pool.

For each named buffer and each layer, a byte view ``[num_rows, row_bytes]``
(row ``r`` of layer ``l`` starts at ``base[l] + r * pitch``). A KV cache is a
row pool whose rows are token slots; a layer-first staging buffer is a row
pool whose rows are ``slot * page_tokens + t``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BufferRows:
    """The rows of one buffer: one uint8 view ``[num_rows, row_bytes]`` per layer."""

    name: str
    layers: tuple[torch.Tensor, ...]  # uint8 [num_rows, row_bytes], stride (pitch, 1)
    row_bytes: int
    pitch: int  # bytes from one row to the next, the same in every layer
    num_rows: int
    device: torch.device
    dtype: torch.dtype  # the element type the engine sees (uint8 for staging)
    row_shape: tuple[int, ...]  # the engine's shape of one row
    # Addresses the device uses for each layer's base (UVA addresses of pinned host memory).
    device_addresses: tuple[int, ...]
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def address_table(self, layers: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int64 tensor of the device addresses of ``layers``, on ``device`` (cached)."""
        key = (layers, str(device))
        table = self._tables.get(key)
        if table is None:
            table = torch.tensor(
                [self.device_addresses[layer] for layer in layers], dtype=torch.int64
            ).to(device)
            self._tables[key] = table
        return table


    def page_views(self, layers: list[int], page_tokens: int) -> list[torch.Tensor]:
        """Per layer in ``layers``, the rows as ``[num_rows // page_tokens, page_tokens *
        row_bytes]`` pages (row ``p * page_tokens + t`` is token ``t`` of page ``p``; a
        trailing part page is left out). Only for rows without padding (cached)."""
        if self.pitch != self.row_bytes:
            raise ValueError(f"buffer {self.name!r} has padded rows (pitch {self.pitch} > "
                             f"{self.row_bytes} bytes): no page views")
        views = self._tables.get(("pages", page_tokens))
        if views is None:
            pages = self.num_rows // page_tokens
            views = tuple(t[: pages * page_tokens].view(pages, page_tokens * self.row_bytes)
                          for t in self.layers)
            self._tables[("pages", page_tokens)] = views
        return [views[i] for i in layers]


class RowPool:
    """A mapping from buffer name to :class:`BufferRows`, in declaration order."""

    def __init__(self, buffers: list[BufferRows], *, kind: str):
        self.buffers = {b.name: b for b in buffers}
        self.kind = kind  # "KVCache" or "StagingBuffer", for messages
        # What two pools must share to copy rows: buffer -> (layers, row bytes).
        self.shape = {b.name: (b.num_layers, b.row_bytes) for b in buffers}
        gpus = [b.device for b in buffers if b.device.type != "cpu"]
        self.device = gpus[0] if gpus else torch.device("cpu")  # where its memory lives

    @property
    def buffer_names(self) -> list[str]:
        return list(self.buffers)

    def geometry(self) -> list[tuple[str, int, int]]:
        """(name, layers, row_bytes) per buffer: what two pools must share to copy rows."""
        return [(name, layers, rb) for name, (layers, rb) in self.shape.items()]


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A uint8 ``[num_rows, row_bytes]`` view of a ``[num_rows, *row_shape]`` tensor whose
    rows are contiguous inside (the row pitch may be larger than the row)."""
    rows = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
    if rows.data_ptr() != t.data_ptr() or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError("rows must be contiguous inside")
    if rows.shape[1] == 0:
        raise ValueError("rows must not be empty")
    return rows.view(torch.uint8)
