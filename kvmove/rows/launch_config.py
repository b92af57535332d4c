"""The one lookup of a row copy's launch config and path on a device: tables registered in
this process (the per-user tuning cache, ``$XDG_CACHE_HOME/kvmove/tuned/<gpu>-triton<version>
.json``, written by ``kvmove tune`` or ``KVMOVE_AUTOTUNE=1``, and trial tables of the
tuner), then the defaults (:mod:`kvmove.kernels.configs`). Nothing here measures or tunes:
tuning (:mod:`kvmove.tuning`) sits above the copy API and writes what this module reads.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from pathlib import Path

import torch

from kvmove.kernels.configs import (
    INTERPRETER_CONFIG,
    LaunchConfig,
    TunedTable,
    config_key,
    default_config,
    gpu_slug,
)
from kvmove.memory import cuda_api

log = logging.getLogger(__name__)

_lock = threading.Lock()
_user_tables: dict[str, TunedTable] = {}  # gpu slug -> the registered user-cache table
_gpu_names: dict[int, str] = {}
# Registered tables, first wins: (gpu slug, or None for every GPU, table).
_registered: list[tuple[str | None, TunedTable]] = []


def triton_version() -> str:
    import triton

    return triton.__version__


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmove" / "tuned"


def cache_path(gpu_name: str, version: str | None = None) -> Path:
    """The user cache file of a GPU and a Triton version."""
    version = triton_version() if version is None else version
    return cache_dir() / f"{gpu_slug(gpu_name)}-triton{version}.json"


def read_cache(path: Path) -> dict:
    """The JSON of a tuning file; ``{}`` when it is missing or unreadable (with a warning)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable tuning cache %s: %s", path, e)
        return {}
    if not isinstance(data, dict):
        log.warning("ignoring the tuning cache %s: not a JSON object", path)
        return {}
    return data


# -- registered tables ------------------------------------------------------------------------
def register_table(table: TunedTable, gpu_name: str | None = None) -> None:
    """Put ``table`` in front of the tables registered so far, for the GPU named
    ``gpu_name`` or, with None, for every GPU. A later registration wins."""
    with _lock:
        _registered.insert(0, (None if gpu_name is None else gpu_slug(gpu_name), table))


def unregister_table(table: TunedTable) -> None:
    """Remove a table registered earlier (every registration of that very object)."""
    with _lock:
        _registered[:] = [(s, t) for s, t in _registered if t is not table]


def tables_for(gpu_name: str) -> list[TunedTable]:
    """The tables consulted for ``gpu_name``, in lookup order (defaults excluded)."""
    slug = gpu_slug(gpu_name)
    with _lock:
        return ([t for s, t in _registered if s == slug]
                + [t for s, t in _registered if s is None])


def pick(direction: str, row_bytes: int, page_tokens: int, gpu_name: str | None) -> LaunchConfig:
    """The launch config for a copy: registered tables, then the defaults. ``gpu_name`` None
    means the Triton interpreter (its one fixed config)."""
    if gpu_name is None:
        return INTERPRETER_CONFIG
    key = config_key(direction, row_bytes, page_tokens)
    for table in tables_for(gpu_name):
        if key in table.configs:
            return table.configs[key]
    return default_config(row_bytes)


def pick_path(direction: str, row_bytes: int, page_tokens: int, gpu_name: str) -> str | None:
    """The path recorded as faster for this shape on this GPU (``"direct"`` or
    ``"two_hop"``), in the lookup order of :func:`pick`; None where none was measured."""
    key = config_key(direction, row_bytes, page_tokens)
    for table in tables_for(gpu_name):
        if key in table.paths:
            return table.paths[key]
    return None


# -- the user cache ---------------------------------------------------------------------------
def user_table(gpu_name: str) -> TunedTable:
    """The user cache of ``gpu_name``, registered on first call (later lookups see what
    ``kvmove tune`` adds to it in this process)."""
    slug = gpu_slug(gpu_name)
    table = _user_tables.get(slug)
    if table is None:
        path = cache_path(gpu_name)
        try:
            table = TunedTable.from_json(read_cache(path))
        except (TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring the malformed tuning cache %s: %s", path, e)
            table = TunedTable()
        with _lock:
            if slug in _user_tables:
                return _user_tables[slug]
            _registered.append((slug, table))  # behind trial tables registered before it
            _user_tables[slug] = table
        if table.configs:
            log.info("using %d tuned configs from %s", len(table.configs), path)
    return table


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(device: torch.device) -> str:
    """The name of the CUDA GPU ``device`` (its index, or the current one), asked of the
    driver once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_name(index)


def config_for(device: torch.device, direction: str, row_bytes: int,
               page_tokens: int) -> LaunchConfig:
    """The kernel's launch config for a copy on ``device``: registered tables (the user
    cache among them), then defaults on a GPU; the interpreter's fixed config on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    name = gpu_name(device)
    user_table(name)
    return pick(direction, row_bytes, page_tokens, name)


def preferred_backend(device: torch.device, direction: str, row_bytes: int,
                      page_tokens: int) -> str:
    """``"two_hop"`` where the tuner recorded that path as faster for this shape on this
    GPU and the copy engine can be driven here (:func:`kvmove.memory.cuda_api.
    copy_engine_problem`), else ``"triton"`` (the direct kernel)."""
    name = gpu_name(device)
    user_table(name)
    if pick_path(direction, row_bytes, page_tokens, name) != "two_hop":
        return "triton"
    problem = cuda_api.copy_engine_problem()
    if problem is not None:
        _warn_once(f"the tuned table prefers the two-hop path for {direction} of "
                   f"{row_bytes}-byte rows, but {problem}: the direct kernel copies instead")
        return "triton"
    return "two_hop"


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def reset() -> None:
    """Forget every registered table (the user caches are re-read on next use)."""
    with _lock:
        _user_tables.clear()
        _registered.clear()
    _device_name.cache_clear()
    _warn_once.cache_clear()
