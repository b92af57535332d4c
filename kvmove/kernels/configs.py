"""Launch configs of the row-copy kernel, as plain data: the config type, the table type
the tuner writes, the defaults per row-size class and the interpreter's fixed config.

A config is keyed by (direction, row-size class, page-tokens class). The lookup (tuned
tables first, then these defaults) lives in :mod:`kvmove.rows.launch_config`; the search
that fills the tables in :mod:`kvmove.tuning`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

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
    """Per key: the launch config, and the faster *path* where it was measured
    (``"direct"``: the kernel writes host memory itself; ``"two_hop"``: the kernel gathers
    into a device ring and the copy engine moves it)."""

    configs: dict[str, LaunchConfig] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)  # key -> "direct" | "two_hop"

    def to_json(self) -> dict:
        return {
            "configs": {k: c.to_dict() for k, c in sorted(self.configs.items())},
            "paths": dict(sorted(self.paths.items())),
        }

    @classmethod
    def from_json(cls, data: dict) -> TunedTable:
        """A table from its JSON form (``{"configs": {...}, "paths": {...}}``); unknown path
        names are dropped."""
        configs = {key: LaunchConfig(**value) for key, value in data.get("configs", {}).items()}
        paths = {k: v for k, v in data.get("paths", {}).items() if v in PATHS}
        return cls(configs=configs, paths=paths)


# The Triton interpreter (CPU) runs one fixed config: few, fat programs.
INTERPRETER_CONFIG = LaunchConfig(block_bytes=256, rows=16, num_warps=1, max_programs=4)

_CAP = DEFAULT_MAX_PROGRAMS
DEFAULTS = {
    "tiny": LaunchConfig(block_bytes=256, rows=32, num_warps=4, max_programs=_CAP),
    "small": LaunchConfig(block_bytes=1024, rows=8, num_warps=4, max_programs=_CAP),
    "medium": LaunchConfig(block_bytes=2048, rows=4, num_warps=8, max_programs=_CAP),
    "large": LaunchConfig(block_bytes=4096, rows=2, num_warps=8, max_programs=_CAP),
}


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
    return DEFAULTS[row_class(row_bytes)]


def gpu_slug(name: str) -> str:
    """A file-name-safe form of a GPU name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
