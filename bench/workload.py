"""The data of one (row size, page size) combination: a KV cache of random bytes on the
device, its layer-first staging (pinned on CUDA) and, per page count, the pages to move.

The cache is given as an engine gives it (``cache``): ``"stacked"``, one ``[L, rows,
row_bytes]`` tensor (also what per-layer views of one storage look like, as vLLM's are);
``"per_layer"``, ``L`` separately allocated ``[rows, row_bytes]`` tensors (SGLang's device
pools).

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
CACHES = ("stacked", "per_layer")


class Workload:
    def __init__(self, row_bytes: int, page_tokens: int, max_pages: int, layers: int,
                 device: torch.device, *, seed: int = 0, cache: str = "stacked"):
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        self.row_bytes, self.page_tokens, self.layers = row_bytes, page_tokens, layers
        self.max_pages = max_pages
        self.device = device
        self.seed = seed
        self.cache = cache
        rows = max_pages * page_tokens
        g = torch.Generator(device=device).manual_seed(seed)
        if cache == "stacked":
            self.kv_tensor = torch.randint(0, 256, (layers, rows, row_bytes),
                                           dtype=torch.uint8, device=device, generator=g)
            self.kv_layers = list(self.kv_tensor.unbind(0))
        else:  # one allocation per layer, as an engine's per-layer pools
            self.kv_tensor = None
            self.kv_layers = [torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8,
                                            device=device, generator=g) for _ in range(layers)]
        self.kv = kvmove.KVCache({"kv": self.kv_tensor if cache == "stacked"
                                  else self.kv_layers})
        self.staging = kvmove.StagingBuffer(self.kv, num_slots=max_pages, page_tokens=page_tokens)
        staging = self.staging.tensor("kv")  # random bytes too, made where it is fastest
        staging.copy_(torch.randint(0, 256, staging.shape, dtype=torch.uint8, device=device,
                                    generator=g))
        self._indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._mirror: HostMemory | None = None
        self._flat_kv: torch.Tensor | None = None  # the bulk baseline's, of a per-layer cache

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
        return self.kv_layers[layer]

    def staging_layer(self, layer: int) -> torch.Tensor:
        """``[slots * page_tokens, row_bytes]`` rows of one staging layer (host)."""
        return self.staging.tensor("kv")[layer].view(-1, self.row_bytes)

    def flat(self, side: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the KV or staging memory as one contiguous uint8 tensor
        (of a per-layer cache: of one contiguous tensor of the cache's size, made once)."""
        if side != "kv":
            return self.staging.tensor("kv").view(-1)[:nbytes]
        if self.kv_tensor is None:
            if self._flat_kv is None:
                self._flat_kv = torch.stack(self.kv_layers)
            return self._flat_kv.view(-1)[:nbytes]
        return self.kv_tensor.view(-1)[:nbytes]

    def mirror(self) -> torch.Tensor:
        """Host memory (pinned on CUDA) shaped like the KV: the CPU-rearrange baseline's."""
        shape = (self.layers, *self.kv_layers[0].shape)
        if self._mirror is None:
            self._mirror = HostMemory(self.layers * self.kv_layers[0].numel(),
                                      pin=self.device.type == "cuda")
        return self._mirror.tensor.view(shape)

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
