"""The benchmark grid: row sizes, page sizes and page counts, per device, under a byte cap
so a run stays short (a combination whose smallest page count exceeds the cap still runs
once, at that count)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROW_BYTES = (132, 656, 1152, 4096)  # fp8 indexer + scale, DSA fp8 MLA, bf16 MLA 576, wide
PAGE_TOKENS = (1, 16, 64)
PAGES = (256, 1024, 4096)
DIRECTIONS = ("gather", "scatter")
CACHES = ("stacked", "per_layer")  # one [L, rows, ...] tensor; L separately allocated layers


@dataclass(frozen=True)
class Case:
    direction: str
    row_bytes: int
    page_tokens: int
    pages: int
    layers: int

    @property
    def rows(self) -> int:
        return self.pages * self.page_tokens

    @property
    def nbytes(self) -> int:
        return self.layers * self.rows * self.row_bytes


@dataclass
class Settings:
    device: torch.device
    quick: bool
    layers: int
    max_bytes: int  # per side of a copy
    warmup: int
    repeats: int
    max_calls: int  # per timed run of a per-row / per-page loop baseline
    min_sample_s: float = 0.0  # a sample of a shorter call is several calls back to back
    row_bytes: tuple[int, ...] = ROW_BYTES
    page_tokens: tuple[int, ...] = PAGE_TOKENS
    pages: tuple[int, ...] = PAGES
    directions: tuple[str, ...] = DIRECTIONS
    caches: tuple[str, ...] = CACHES
    methods: tuple[str, ...] | None = None  # None: every method that runs on the device
    extra: dict = field(default_factory=dict)

    @classmethod
    def defaults(cls, device: torch.device, *, quick: bool) -> Settings:
        if device.type == "cuda":
            return cls(device=device, quick=quick, layers=61, max_bytes=(1 if quick else 4) << 30,
                       warmup=2, repeats=5 if quick else 9, max_calls=4000,
                       pages=(256, 4096) if quick else PAGES)
        return cls(device=device, quick=quick, layers=4 if quick else 8,
                   max_bytes=(48 if quick else 256) << 20, warmup=1, repeats=5 if quick else 9,
                   max_calls=20000, min_sample_s=0.005 if quick else 0.02,
                   pages=(256, 4096) if quick else PAGES)

    def to_json(self) -> dict:
        return {
            "device": str(self.device), "quick": self.quick, "layers": self.layers,
            "max_bytes": self.max_bytes, "warmup": self.warmup, "repeats": self.repeats,
            "max_calls": self.max_calls, "min_sample_s": self.min_sample_s,
            "row_bytes": list(self.row_bytes),
            "page_tokens": list(self.page_tokens), "pages": list(self.pages),
            "directions": list(self.directions), "caches": list(self.caches),
            "methods": None if self.methods is None else list(self.methods),
        }


def page_counts(settings: Settings, row_bytes: int, page_tokens: int) -> list[int]:
    """The page counts of one (row size, page size) that fit the byte cap; the smallest
    one when none does."""
    pages = sorted(settings.pages)
    fit = [p for p in pages if settings.layers * p * page_tokens * row_bytes <= settings.max_bytes]
    return fit or pages[:1]


def grid(settings: Settings) -> list[tuple[int, int, list[int]]]:
    """``(row_bytes, page_tokens, page counts)`` for every combination to run."""
    return [(rb, pt, page_counts(settings, rb, pt))
            for rb in settings.row_bytes for pt in settings.page_tokens]
