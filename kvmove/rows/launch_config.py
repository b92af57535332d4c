"""The launch config and path of a row copy on a device, looked up in tables only: the
per-user tuning cache (``$XDG_CACHE_HOME/kvmove/tuned/<gpu>-triton<version>.json``, written
by ``kvmove tune``), the tables shipped in ``kvmove/kernels/tuned/``, then the defaults
(:mod:`kvmove.kernels.configs`). Nothing here measures or tunes: tuning
(:mod:`kvmove.tuning`) sits above the copy API and writes the files this module reads.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import torch

from kvmove.kernels import configs
from kvmove.kernels.configs import LaunchConfig, TunedTable

log = logging.getLogger(__name__)

_lock = threading.Lock()
_user_tables: dict[str, TunedTable] = {}  # gpu slug -> the registered user-cache table
_gpu_names: dict[int, str] = {}


def triton_version() -> str:
    import triton

    return triton.__version__


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmove" / "tuned"


def cache_path(gpu_name: str, version: str | None = None) -> Path:
    """The user cache file of a GPU and a Triton version."""
    version = triton_version() if version is None else version
    return cache_dir() / f"{configs.gpu_slug(gpu_name)}-triton{version}.json"


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


def user_table(gpu_name: str) -> TunedTable:
    """The user cache of ``gpu_name``, registered in front of the shipped tables on first
    call (later lookups see what ``kvmove tune`` adds to it in this process)."""
    slug = configs.gpu_slug(gpu_name)
    table = _user_tables.get(slug)
    if table is None:
        with _lock:
            table = _user_tables.get(slug)
            if table is None:
                path = cache_path(gpu_name)
                try:
                    table = configs.tuned_table_from_json(read_cache(path))
                except (TypeError, ValueError, AttributeError) as e:
                    log.warning("ignoring the malformed tuning cache %s: %s", path, e)
                    table = TunedTable()
                configs.register_table(table, gpu_name)
                _user_tables[slug] = table
                if table.configs:
                    log.info("using %d tuned configs from %s", len(table.configs), path)
    return table


def gpu_name(device: torch.device) -> str:
    """The name of the CUDA GPU ``device`` (its index, or the current one), asked of the
    driver once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _gpu_names.get(index)
    if name is None:
        name = _gpu_names.setdefault(index, torch.cuda.get_device_name(index))
    return name


def config_for(device: torch.device, direction: str, row_bytes: int,
                  page_tokens: int) -> LaunchConfig:
    """The kernel's launch config for a copy on ``device``: user cache, shipped table,
    defaults on a GPU; the interpreter's fixed config on the CPU."""
    if device.type != "cuda":
        return configs.pick(direction, row_bytes, page_tokens, None)
    name = gpu_name(device)
    user_table(name)
    return configs.pick(direction, row_bytes, page_tokens, name)


def preferred_backend(device: torch.device, direction: str, row_bytes: int,
                      page_tokens: int) -> str:
    """``"two_hop"`` where the tuner recorded that path as faster for this shape on this GPU
    (user cache, then shipped table), else ``"triton"`` (the direct kernel)."""
    name = gpu_name(device)
    user_table(name)
    path = configs.pick_path(direction, row_bytes, page_tokens, name)
    return "two_hop" if path == "two_hop" else "triton"


def reset() -> None:
    """Forget the registered user caches and the shipped tables read so far."""
    with _lock:
        _user_tables.clear()
        _gpu_names.clear()
        configs.clear_registered()
        configs.clear_shipped_cache()
