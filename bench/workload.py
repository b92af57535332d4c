"""The data of one (row size, page size) combination: a KV cache of random bytes (one
stacked ``[L, rows, row_bytes]`` tensor on the device), its layer-first staging (pinned on
CUDA) and, per page count, the pages to move.

A case with ``n`` pages moves whole KV pages in a random order (KV page ``perm[i]`` holds
tokens ``perm[i] * page_tokens ..``, so a page-layer span is contiguous on both sides, as
with a paged KV cache) into staging slots ``0..n-1`` (what a fresh allocator hands out).
The KV rows touched are exactly rows ``0 .. n * page_tokens - 1`` of every layer.
"""

from __future__ import annotations

import torch

import kvmove
from kvmove.memory.host_memory import HostMemory

POISON = 0xA5


class Workload:
    def __init__(self, row_bytes: int, page_tokens: int, max_pages: int, layers: int,
                 device: torch.device, *, seed: int = 0):
        self.row_bytes, self.page_tokens, self.layers = row_bytes, page_tokens, layers
        self.max_pages = max_pages
        self.device = device
        self.seed = seed
        rows = max_pages * page_tokens
        g = torch.Generator(device=device).manual_seed(seed)
        self.kv_tensor = torch.randint(0, 256, (layers, rows, row_bytes), dtype=torch.uint8,
                                       device=device, generator=g)
        self.kv = kvmove.KVCache({"kv": self.kv_tensor})
        self.staging = kvmove.StagingBuffer(self.kv, num_slots=max_pages, page_tokens=page_tokens)
        staging = self.staging.tensor("kv")  # random bytes too, made where it is fastest
        staging.copy_(torch.randint(0, 256, staging.shape, dtype=torch.uint8, device=device,
                                    generator=g))
        self._indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._mirror: HostMemory | None = None

    # -- a case ---------------------------------------------------------------------------
    def indices(self, pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(token_pages [pages, page_tokens], slots [pages], rows [pages * page_tokens])``
        on the CPU, int64; ``rows`` is ``token_pages`` flattened: KV row of staging row i."""
        if pages not in self._indices:
            perm = torch.randperm(pages, generator=torch.Generator().manual_seed(self.seed + pages))
            token_pages = perm[:, None] * self.page_tokens + torch.arange(self.page_tokens)
            self._indices[pages] = (token_pages, torch.arange(pages), token_pages.reshape(-1))
        return self._indices[pages]

    def kv_layer(self, layer: int) -> torch.Tensor:
        """``[rows, row_bytes]`` of one KV layer, on the device."""
        return self.kv_tensor[layer]

    def staging_layer(self, layer: int) -> torch.Tensor:
        """``[slots * page_tokens, row_bytes]`` rows of one staging layer (host)."""
        return self.staging.tensor("kv")[layer].view(-1, self.row_bytes)

    def flat(self, side: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the KV or staging memory as one contiguous uint8 tensor."""
        t = self.kv_tensor if side == "kv" else self.staging.tensor("kv")
        return t.view(-1)[:nbytes]

    def mirror(self) -> torch.Tensor:
        """Host memory (pinned on CUDA) shaped like the KV: the CPU-rearrange baseline's."""
        if self._mirror is None:
            self._mirror = HostMemory(self.kv_tensor.numel(), pin=self.device.type == "cuda")
        return self._mirror.tensor.view(self.kv_tensor.shape)

    # -- checking what a method wrote -----------------------------------------------------
    def poison(self, direction: str, pages: int) -> None:
        """Overwrite what a copy of ``pages`` pages writes, so a copy that writes nothing
        (or the wrong rows) cannot pass :meth:`check`."""
        n = pages * self.page_tokens
        for layer in range(self.layers):
            target = self.staging_layer(layer) if direction == "gather" else self.kv_layer(layer)
            target[:n].fill_(POISON)

    def check(self, direction: str, pages: int) -> None:
        """Raise unless staging row i holds KV row ``rows[i]`` in every layer."""
        _, _, rows = self.indices(pages)
        n = len(rows)
        for layer in range(self.layers):
            kv_rows = self.kv_layer(layer).index_select(0, rows.to(self.device)).cpu()
            if not torch.equal(kv_rows, self.staging_layer(layer)[:n]):
                raise AssertionError(
                    f"{direction} of {pages} pages ({self.row_bytes}-byte rows, "
                    f"{self.page_tokens}-token pages) wrote wrong bytes in layer {layer}")

    def close(self) -> None:
        self.staging.close()
        if self._mirror is not None:
            self._mirror.close()
