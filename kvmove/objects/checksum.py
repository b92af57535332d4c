"""End-to-end object checksums: a 64-bit fingerprint of a staged page, computed on the host
from the staging after the gather, stored as the object's 8-byte trailer, checked after a
get before any byte is scattered. ``sum_s M^(S-1-s) * (l_s + 1 + sum_j w[j] * word_s[j])``
mod 2^64 over the spans in object order, words signed 32-bit (bytes where rows are not a
multiple of 4), odd weights below 2^31, odd ``M``: any one changed byte is always caught
(the proof, costs and interplay: docs/INTEGRITY.md). The values of kvmove's earlier
per-layer loop, now one ``numpy.einsum`` per (buffer, valid-token count) over a
``[layers, pages, words]`` view: no Python loop over pages or layers."""

from __future__ import annotations

import numpy as np
import torch

from kvmove.memory.staging import StagingBuffer

TRAILER_BYTES = 8
_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant


def _pick(spans: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``spans[:, slots]``: a view when ``slots`` is one ascending run, else a copy."""
    first = int(slots[0])
    if int(slots[-1]) - first == slots.size - 1 and (
            slots.size < 3 or bool((np.diff(slots) == 1).all())):
        return spans[:, first:first + slots.size]
    return spans.take(slots, axis=1)


class PageChecksum:
    """Computes the fingerprints of pages held in a staging buffer."""

    def __init__(self, staging: StagingBuffer, seed: int = 0x6B766D76):
        self.staging = staging
        g = torch.Generator().manual_seed(seed)
        page_first = staging.layout == "page_first"
        # Per buffer: its spans as a [spans, num_slots, words] numpy view, the words of one
        # token in a span, one odd weight per word of a span, and its first span's index.
        self._buffers = []
        first = 0
        for name in staging.buffer_names:
            staged, row_bytes = staging.tensor(name), staging.row_bytes(name)
            word = 4 if row_bytes % 4 == 0 else 1
            spans = staged.view(1, staging.num_slots, -1) if page_first else staged
            words = spans.numpy().view(np.int32 if word == 4 else np.uint8)
            token_bytes = row_bytes * (staging.num_layers(name) if page_first else 1)
            weights = torch.randint(0, 2**30, (words.shape[2],), generator=g,
                                    dtype=torch.int64) * 2 + 1
            self._buffers.append((words, token_bytes // word,
                                  weights.numpy().view(np.uint64), first))
            first += words.shape[0]
        # The span constants ``l_s + 1`` and the factors M^(S-1-s) modulo 2^64, object order.
        self._constants = np.concatenate([np.arange(1, w.shape[0] + 1, dtype=np.uint64)
                                          for w, *_ in self._buffers])
        spans = self._constants.size
        self._factors = np.array([pow(_MIX, spans - 1 - s, 2**64) for s in range(spans)],
                                 dtype=np.uint64)

    def compute(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> torch.Tensor:
        """int64 ``[n]`` fingerprints of the pages in ``slots`` (``valid_tokens`` rows each)."""
        slots_np, valid = self._checked(slots, valid_tokens)
        n = slots_np.size
        if n == 0:
            return torch.zeros(0, dtype=torch.int64)
        sums = np.zeros((self._constants.size, n), dtype=np.uint64)
        counts, group_of = np.unique(valid, return_inverse=True)
        for g, count in enumerate(counts.tolist()):  # distinct valid-token counts
            pages = np.arange(n) if counts.size == 1 else np.flatnonzero(group_of == g)
            group_slots = slots_np[pages]
            for words, token_words, weights, first in self._buffers:
                cols = count * token_words
                picked = _pick(words, group_slots)[:, :, :cols]
                # words widened to 64 bits (int32 sign-extended) in einsum's buffers;
                # unsigned arithmetic: the sums wrap modulo 2^64, as they must
                sums[first:first + words.shape[0], pages] = np.einsum(
                    "lnj,j->ln", picked, weights[:cols], dtype=np.uint64, casting="unsafe")
        sums += self._constants[:, None]
        total = np.einsum("sn,s->n", sums, self._factors)
        return torch.from_numpy(np.ascontiguousarray(total).view(np.int64))

    def write(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> None:
        """Store the fingerprints in the slots' trailers."""
        trailer = self.staging.trailer
        trailer[slots.cpu()] = self.compute(slots, valid_tokens).view(torch.uint8).view(-1, 8)

    def matches(self, slots: torch.Tensor, valid_tokens: torch.Tensor) -> torch.Tensor:
        """bool ``[n]``: the pages' bytes match the fingerprints in their trailers."""
        stored = self.staging.trailer[slots.cpu()].contiguous().view(torch.int64).view(-1)
        return self.compute(slots, valid_tokens) == stored

    def _checked(self, slots, valid_tokens) -> tuple[np.ndarray, np.ndarray]:
        """``slots`` and ``valid_tokens`` as int64 arrays, or a ValueError naming the bad one."""
        s = torch.as_tensor(slots).to(torch.int64).cpu().reshape(-1).numpy()
        v = torch.as_tensor(valid_tokens).to(torch.int64).cpu().reshape(-1).numpy()
        if v.size != s.size:
            raise ValueError(f"valid_tokens has {v.size} entries, slots has {s.size}")
        if s.size and (s.min() < 0 or s.max() >= self.staging.num_slots):
            raise ValueError(f"slots must lie in [0, {self.staging.num_slots}), got "
                             f"{s.min()}..{s.max()}")
        if v.size and (v.min() < 1 or v.max() > self.staging.page_tokens):
            raise ValueError(f"valid_tokens must lie in [1, {self.staging.page_tokens}], got "
                             f"{v.min()}..{v.max()}")
        return s, v
