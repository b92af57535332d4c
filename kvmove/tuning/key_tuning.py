"""Tuning one key ``(direction, row-size class, page-tokens class)`` on a GPU: the best
launch config by :func:`~kvmove.tuning.config_search.search`, timed with
``triton.testing.do_bench``, and the direct path against the two-hop path; the results file
(the shipped tables' format) that :mod:`kvmove.rows.launch_config` reads."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmove.kernels import configs
from kvmove.kernels.configs import LaunchConfig, TunedTable
from kvmove.rows import launch_config
from kvmove.rows.launch_config import read_cache, triton_version
from kvmove.tuning.config_search import search, start_config
from kvmove.tuning.workload import Workload

DIRECTIONS = ("gather", "scatter")
# One representative shape per class (configs.row_class / configs.tokens_class).
CLASS_ROW_BYTES = {"tiny": 132, "small": 656, "medium": 1152, "large": 8192}
CLASS_PAGE_TOKENS = {"p1": 1, "p16": 16, "p64": 64}


@dataclass
class KeyResult:
    """The outcome of tuning one key."""

    key: str
    direction: str
    row_bytes: int
    page_tokens: int
    layers: int
    nbytes: int
    config: LaunchConfig
    config_gbps: float
    default_gbps: float
    evaluated: int
    direct_gbps: float | None = None
    two_hop_gbps: float | None = None

    @property
    def path(self) -> str | None:
        if self.direct_gbps is None or self.two_hop_gbps is None:
            return None
        return "two_hop" if self.two_hop_gbps > self.direct_gbps else "direct"

    def measurement(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("key", "config"):
            out.pop(name)
        out["path"] = self.path
        return out


def write_results(path: Path, gpu_name: str, results: list[KeyResult]) -> dict:
    """Merge ``results`` into the tuning file at ``path`` (written atomically); returns the
    file's new JSON."""
    data = read_cache(path)
    data.update({
        "gpu": gpu_name,
        "slug": configs.gpu_slug(gpu_name),
        "triton": triton_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    for section in ("configs", "paths", "measurements"):
        data.setdefault(section, {})
    for r in results:
        data["configs"][r.key] = r.config.to_dict()
        data["measurements"][r.key] = r.measurement()
        if r.path is not None:
            data["paths"][r.key] = r.path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return data


def apply(table: TunedTable, results: list[KeyResult]) -> None:
    """Put tuning results into a registered table (in place: lookups see them at once)."""
    for r in results:
        table.configs[r.key] = r.config
        if r.path is not None:
            table.paths[r.key] = r.path


def bench_seconds(fn: Callable[[], None], *, quick: bool) -> float:
    """Median seconds of ``fn`` by ``triton.testing.do_bench`` (CUDA events)."""
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (10, 50)
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3


def tune_key(device: torch.device, direction: str, row_bytes: int, page_tokens: int, *,
             quick: bool = False, layers: int = 8, target_bytes: int | None = None,
             max_programs: int = configs.DEFAULT_MAX_PROGRAMS,
             compare_paths: bool = True) -> KeyResult:
    """Tune the launch config of one key on ``device`` and, with ``compare_paths``, time the
    direct path (with that config) against the two-hop path."""
    target = target_bytes or ((32 if quick else 96) << 20)
    key = configs.config_key(direction, row_bytes, page_tokens)
    work = Workload(device, row_bytes, page_tokens, layers=layers, target_bytes=target)
    try:
        run = work.launcher(direction)
        best, seen = search(lambda c: bench_seconds(lambda: run(c), quick=quick), row_bytes,
                            max_programs=max_programs, passes=1 if quick else 2, quick=quick)
        start = start_config(row_bytes, max_programs)
        result = KeyResult(
            key=key, direction=direction, row_bytes=row_bytes, page_tokens=page_tokens,
            layers=layers, nbytes=work.nbytes, config=best,
            config_gbps=work.nbytes / seen[best] / 1e9,
            default_gbps=work.nbytes / seen[start] / 1e9, evaluated=len(seen),
        )
        if compare_paths:
            gpu_name = torch.cuda.get_device_name(device)
            trial = TunedTable(configs={key: best})
            launch_config.register_table(trial, gpu_name)
            try:
                direct = bench_seconds(work.copier(direction, "triton"), quick=quick)
                two_hop = bench_seconds(work.copier(direction, "two_hop"), quick=quick)
            finally:
                launch_config.unregister_table(trial)
            result.direct_gbps = work.nbytes / direct / 1e9
            result.two_hop_gbps = work.nbytes / two_hop / 1e9
        return result
    finally:
        work.close()
