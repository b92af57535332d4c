"""Launch configs of the row-copy kernel: one place, keyed by (direction, row-size class,
page-tokens class), looked up in tuned tables first, then defaults.

A tuned table holds, per key, a :class:`LaunchConfig` and optionally the faster *path*
(``"direct"``: the kernel writes host memory itself; ``"two_hop"``: the kernel gathers into
a device ring and the copy engine moves it). Lookup order for a GPU: tables registered at
run time for that GPU (the per-user tuning cache registers its own), then tables registered
for every GPU, then the table shipped beside this module as ``tuned/<gpu-slug>.json``, then
the defaults.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")
DEFAULT_MAX_PROGRAMS = 16  # leave the SMs to the engine's forward pass
PATHS = ("direct", "two_hop")


@dataclass(frozen=True)
class LaunchConfig:
    block_bytes: int  # bytes of a row copied per inner step (a power of two)
    rows: int  # rows handled together by one program step (a power of two)
    num_warps: int
    max_programs: int  # cap on the grid

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TunedTable:
    """Per key: the launch config, and the faster path where it was measured."""

    configs: dict[str, LaunchConfig] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # key -> "direct" | "two_hop"

    def to_json(self) -> dict:
        return {
            "configs": {k: c.to_dict() for k, c in sorted(self.configs.items())},
            "paths": dict(sorted(self.paths.items())),
        }


# The Triton interpreter (CPU) runs one fixed config: few, fat programs.
INTERPRETER_CONFIG = LaunchConfig(block_bytes=256, rows=16, num_warps=1, max_programs=4)

_CAP = DEFAULT_MAX_PROGRAMS
_DEFAULTS = {
    "tiny": LaunchConfig(block_bytes=256, rows=32, num_warps=4, max_programs=_CAP),
    "small": LaunchConfig(block_bytes=1024, rows=8, num_warps=4, max_programs=_CAP),
    "medium": LaunchConfig(block_bytes=2048, rows=4, num_warps=8, max_programs=_CAP),
    "large": LaunchConfig(block_bytes=4096, rows=2, num_warps=8, max_programs=_CAP),
}

# Run-time tables, first wins: (gpu slug or None for every GPU, table).
_registered: list[tuple[str | None, TunedTable]] = []
_shipped: dict[str, TunedTable] = {}  # gpu slug -> table, loaded lazily


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


def default_config(row_bytes: int) -> LaunchConfig:
    return _DEFAULTS[row_class(row_bytes)]


@functools.lru_cache(maxsize=64)
def gpu_slug(name: str) -> str:
    """A file-name-safe form of a GPU name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_from_json(data: dict) -> dict[str, LaunchConfig]:
    return {key: LaunchConfig(**value) for key, value in data.get("configs", {}).items()}


def tuned_table_from_json(data: dict) -> TunedTable:
    """A :class:`TunedTable` from its JSON form (``{"configs": {...}, "paths": {...}}``);
    unknown path names are dropped."""
    paths = {k: v for k, v in data.get("paths", {}).items() if v in PATHS}
    return TunedTable(configs=table_from_json(data), paths=paths)


def shipped_table(gpu_name: str) -> TunedTable:
    slug = gpu_slug(gpu_name)
    if slug not in _shipped:
        path = TUNED_DIR / f"{slug}.json"
        _shipped[slug] = (
            tuned_table_from_json(json.loads(path.read_text())) if path.exists() else TunedTable()
        )
    return _shipped[slug]


def register_table(table: dict[str, LaunchConfig] | TunedTable,
                   gpu_name: str | None = None) -> None:
    """Put a tuned table in front of the shipped ones (the user's tuning cache), for the GPU
    named ``gpu_name`` or, with None, for every GPU. A later registration wins."""
    if not isinstance(table, TunedTable):
        table = TunedTable(configs=dict(table))
    _registered.insert(0, (None if gpu_name is None else gpu_slug(gpu_name), table))


def unregister_table(table: TunedTable) -> None:
    """Remove a table registered earlier (every registration of that very object)."""
    _registered[:] = [(s, t) for s, t in _registered if t is not table]


def clear_registered() -> None:
    _registered.clear()


def clear_shipped_cache() -> None:
    """Forget the shipped tables read so far (they are re-read on next use)."""
    _shipped.clear()


def tables_for(gpu_name: str) -> list[TunedTable]:
    """The tables consulted for ``gpu_name``, in lookup order (defaults excluded)."""
    slug = gpu_slug(gpu_name)
    mine = [t for s, t in _registered if s == slug]
    everyone = [t for s, t in _registered if s is None]
    return [*mine, *everyone, shipped_table(gpu_name)]


def pick(direction: str, row_bytes: int, page_tokens: int, gpu_name: str | None) -> LaunchConfig:
    """The launch config for a copy: registered tables, then the GPU's shipped table, then
    the defaults. ``gpu_name`` None means the Triton interpreter."""
    if gpu_name is None:
        return INTERPRETER_CONFIG
    key = config_key(direction, row_bytes, page_tokens)
    for table in tables_for(gpu_name):
        if key in table.configs:
            return table.configs[key]
    return default_config(row_bytes)


def pick_path(direction: str, row_bytes: int, page_tokens: int, gpu_name: str) -> str | None:
    """The path recorded as faster for this shape on this GPU (``"direct"`` or
    ``"two_hop"``), in the same lookup order as :func:`pick`; None where none was measured."""
    key = config_key(direction, row_bytes, page_tokens)
    for table in tables_for(gpu_name):
        if key in table.paths:
            return table.paths[key]
    return None
