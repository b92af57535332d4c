"""End-to-end object checksums: a 64-bit fingerprint of a staged page, computed on the host
from the staging bytes after the gather and stored as the object's 8-byte trailer; checked
after a get, before any byte is scattered into the KV cache.

The fingerprint is ``sum_l M^(L-1-l) * (l + 1 + sum_j w[j] * word_l[j])`` modulo 2^64 over
the page's spans in object order, where ``word`` reads a span as 32-bit words (bytes where
the row size is not a multiple of 4) and the weights are odd pseudo-random numbers below
2^31: a single changed byte changes its word by ``d * 2^(8k)`` with ``0 < d < 256``, and an
odd weight times that is never 0 modulo 2^64, so any one changed byte is always detected;
swapped or shifted spans almost surely are. Vectorised over pages; the Python loop runs over
(buffer, layer) spans only. A page-first staging has one span per buffer (all layers of a
token side by side), so there the sum runs over buffers only.
"""

from __future__ import annotations

import torch

from kvmove.memory.staging import StagingBuffer

TRAILER_BYTES = 8
_MIX = 0x9E3779B97F4A7C15 - 2**64  # an odd 64-bit constant, as a signed int64


class PageChecksum:
    """Computes the fingerprints of pages held in a staging buffer."""

    def __init__(self, staging: StagingBuffer, seed: int = 0x6B766D76):
        self.staging = staging
        g = torch.Generator().manual_seed(seed)
        # Per buffer: its spans as [spans, num_slots, span_bytes], the bytes of one token in
        # a span, the word size its rows allow, and one odd weight per word of a span.
        page_first = staging.layout == "page_first"
        self._spans, self._token_bytes, self._word, self._weights = {}, {}, {}, {}
        for name in staging.buffer_names:
            staged, row_bytes = staging.tensor(name), staging.row_bytes(name)
            spans = staged.view(1, staging.num_slots, -1) if page_first else staged
            self._spans[name] = spans
            self._token_bytes[name] = row_bytes * (staging.num_layers(name) if page_first
                                                   else 1)
            self._word[name] = 4 if row_bytes % 4 == 0 else 1
            self._weights[name] = torch.randint(
                0, 2**30, (spans.shape[2] // self._word[name],), generator=g,
                dtype=torch.int64) * 2 + 1

    def compute(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` fingerprints of the pages in ``slots`` (``valid_tokens`` rows each)."""
        slots = slots.to(torch.int64).cpu()
        valid = valid_tokens.to(torch.int64).cpu()
        total = torch.zeros(slots.numel(), dtype=torch.int64)
        for name in self.staging.buffer_names:
            word = self._word[name]
            staged = self._spans[name]
            words = staged.view(torch.int32) if word == 4 else staged
            weights = self._weights[name]
            cols = torch.arange(weights.numel())
            keep = cols[None, :] < (valid * (self._token_bytes[name] // word))[:, None]
            masked = torch.where(keep, weights[None, :], torch.zeros((), dtype=torch.int64))
            for layer in range(staged.shape[0]):
                page = words[layer].index_select(0, slots).to(torch.int64)
                total = total * _MIX + (page * masked).sum(dim=1) + (layer + 1)
        return total

    def write(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> None:
        """Store the fingerprints in the slots' trailers."""
        trailer = self.staging.trailer
        trailer[slots.cpu()] = self.compute(slots, valid_tokens).view(torch.uint8).view(-1, 8)

    def matches(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> torch.Tensor:
        """bool ``[n]``: the pages' bytes match the fingerprints in their trailers."""
        stored = self.staging.trailer[slots.cpu()].contiguous().view(torch.int64).view(-1)
        return self.compute(slots, valid_tokens) == stored
