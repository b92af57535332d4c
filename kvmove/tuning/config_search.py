"""The search over the row-copy kernel's launch configs: coordinate descent from the
row class's default over bytes per step, rows per step, warps and the programs cap."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvmove.kernels import configs
from kvmove.kernels.configs import LaunchConfig

# The search space; caps above the user's limit are never tried.
BLOCK_BYTES = (128, 256, 512, 1024, 2048, 4096, 8192)
ROWS = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8, 16)
PROGRAM_CAPS = (4, 8, 16, 32, 64, 132)
# --quick: fewer values (each new combination is a Triton compile, about a second).
QUICK_AXES = {"rows": (2, 4, 8, 16, 32), "num_warps": (2, 4, 8)}
MAX_TILE_BYTES = 64 << 10  # rows * block bytes held by one program step


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def valid(config: LaunchConfig, row_bytes: int, max_programs: int) -> bool:
    """Whether a config is worth timing for rows of ``row_bytes``: no block wider than the
    row (the kernel clamps it: a duplicate), no cap above ``max_programs``, a tile that fits
    in registers."""
    block = min(config.block_bytes, max(_pow2_at_least(row_bytes), BLOCK_BYTES[0]))
    return (
        config.block_bytes == block
        and config.max_programs <= max_programs
        and config.rows * config.block_bytes <= MAX_TILE_BYTES
    )


def start_config(row_bytes: int, max_programs: int) -> LaunchConfig:
    """The default config of the row class, made valid for ``row_bytes`` and the cap."""
    c = configs.default_config(row_bytes)
    block = min(c.block_bytes, max(_pow2_at_least(row_bytes), BLOCK_BYTES[0]))
    return dataclasses.replace(c, block_bytes=block,
                               max_programs=min(c.max_programs, max_programs))


def search(measure: Callable[[LaunchConfig], float], row_bytes: int, *, max_programs: int,
           passes: int = 2, quick: bool = False) -> tuple[LaunchConfig, dict[LaunchConfig, float]]:
    """Coordinate descent over the launch parameters: starting at the class default, try
    every value of one parameter with the others fixed, keep the fastest, go on to the next
    parameter; ``passes`` rounds (fewer values with ``quick``). ``measure(config)`` returns
    seconds. Returns the best config and every timing taken."""
    axes = {"block_bytes": BLOCK_BYTES, "rows": ROWS, "num_warps": WARPS,
            "max_programs": PROGRAM_CAPS}
    if quick:
        axes.update(QUICK_AXES)
    seen: dict[LaunchConfig, float] = {}

    def time_of(config: LaunchConfig) -> float:
        if config not in seen:
            seen[config] = measure(config)
        return seen[config]

    best = start_config(row_bytes, max_programs)
    time_of(best)
    for _ in range(passes):
        before = best
        for name, values in axes.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                if valid(candidate, row_bytes, max_programs) and (
                        time_of(candidate) < time_of(best)):
                    best = candidate
        if best == before:
            break
    return best, seen
