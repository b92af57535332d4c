"""Launch configs of the row-copy kernel: one place, keyed by (direction, row-size class,
page-tokens class), looked up in tuned tables first, then defaults.

Tuned tables are JSON files ``tuned/<gpu-name>.json`` shipped beside this module, plus any
tables registered at run time (the per-user tuning cache registers its own first).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")
DEFAULT_MAX_PROGRAMS = 16  # leave the SMs to the engine's forward pass


@dataclass(frozen=True)
class LaunchConfig:
    block_bytes: int  # bytes of a row copied per inner step (a power of two)
    rows: int  # rows handled together by one program step (a power of two)
    num_warps: int
    max_programs: int  # cap on the grid

    def to_dict(self) -> dict:
        return asdict(self)


# The Triton interpreter (CPU) runs one fixed config: few, fat programs.
INTERPRETER_CONFIG = LaunchConfig(block_bytes=256, rows=16, num_warps=1, max_programs=4)

_CAP = DEFAULT_MAX_PROGRAMS
_DEFAULTS = {
    "tiny": LaunchConfig(block_bytes=256, rows=32, num_warps=4, max_programs=_CAP),
    "small": LaunchConfig(block_bytes=1024, rows=8, num_warps=4, max_programs=_CAP),
    "medium": LaunchConfig(block_bytes=2048, rows=4, num_warps=8, max_programs=_CAP),
    "large": LaunchConfig(block_bytes=4096, rows=2, num_warps=8, max_programs=_CAP),
}

_registered: list[dict[str, LaunchConfig]] = []  # run-time tables, first wins
_shipped: dict[str, dict[str, LaunchConfig]] = {}  # gpu slug -> table, loaded lazily


def row_class(row_bytes: int) -> str:
    """The row-size class of a row: tiny (<= 256 B), small (<= 1 KiB), medium (<= 4 KiB), large."""
    if row_bytes <= 256:
        return "tiny"
    if row_bytes <= 1024:
        return "small"
    if row_bytes <= 4096:
        return "medium"
    return "large"


def tokens_class(page_tokens: int) -> str:
    """The page-tokens class: 1, <= 16, or more."""
    if page_tokens <= 1:
        return "p1"
    if page_tokens <= 16:
        return "p16"
    return "p64"


def config_key(direction: str, row_bytes: int, page_tokens: int) -> str:
    return f"{direction}/{row_class(row_bytes)}/{tokens_class(page_tokens)}"


def gpu_slug(name: str) -> str:
    """A file-name-safe form of a GPU name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_from_json(data: dict) -> dict[str, LaunchConfig]:
    return {key: LaunchConfig(**value) for key, value in data.get("configs", {}).items()}


def shipped_table(gpu_name: str) -> dict[str, LaunchConfig]:
    slug = gpu_slug(gpu_name)
    if slug not in _shipped:
        path = TUNED_DIR / f"{slug}.json"
        _shipped[slug] = table_from_json(json.loads(path.read_text())) if path.exists() else {}
    return _shipped[slug]


def register_table(table: dict[str, LaunchConfig]) -> None:
    """Put a tuned table in front of the shipped ones (the user's tuning cache)."""
    _registered.insert(0, table)


def clear_registered() -> None:
    _registered.clear()


def pick(direction: str, row_bytes: int, page_tokens: int, gpu_name: str | None) -> LaunchConfig:
    """The launch config for a copy: registered tables, then the GPU's shipped table, then
    the defaults. ``gpu_name`` None means the Triton interpreter."""
    if gpu_name is None:
        return INTERPRETER_CONFIG
    key = config_key(direction, row_bytes, page_tokens)
    for table in (*_registered, shipped_table(gpu_name)):
        if key in table:
            return table[key]
    return _DEFAULTS[row_class(row_bytes)]
