"""Tuning at build time: with ``KVMOVE_AUTOTUNE=1``, a :class:`~kvmove.KVMover` built on a
GPU tunes the shapes it will copy that the user cache lacks, before it serves (a second or
two per shape class, once: the results go to the user cache). Never inside a copy call.
Failures are logged and remembered, never raised: copies go on with the config found."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

import torch

from kvmove.kernels.configs import config_key
from kvmove.rows.launch_config import cache_path, gpu_name, pick, user_table
from kvmove.tuning.key_tuning import KeyResult, apply, tune_key, write_results

log = logging.getLogger(__name__)

ENV_AUTOTUNE = "KVMOVE_AUTOTUNE"
_lock = threading.Lock()


def autotune_enabled() -> bool:
    return os.environ.get(ENV_AUTOTUNE, "").strip().lower() in ("1", "true", "yes", "on")


def tune_missing(gpu: str, device: torch.device,
                 shapes: Iterable[tuple[str, int, int]]) -> list[KeyResult]:
    """Tune each ``(direction, row_bytes, page_tokens)`` whose key the user cache of GPU
    ``gpu`` lacks, on ``device``; returns what was tuned. Does nothing unless
    ``KVMOVE_AUTOTUNE=1``."""
    if not autotune_enabled():
        return []
    table = user_table(gpu)
    tuned = []
    with _lock:
        for direction, row_bytes, page_tokens in shapes:
            key = config_key(direction, row_bytes, page_tokens)
            if key in table.configs:
                continue
            log.warning("KVMOVE_AUTOTUNE: tuning %s on %s (once; cached in %s)", key, gpu,
                        cache_path(gpu))
            try:
                result = tune_key(device, direction, row_bytes, page_tokens, quick=True)
                write_results(cache_path(gpu), gpu, [result])
            except Exception as e:  # a failed tuning must never break the engine
                log.warning("autotuning %s failed: %s", key, e)
                table.configs[key] = pick(direction, row_bytes, page_tokens, gpu)
                continue
            apply(table, [result])
            tuned.append(result)
    return tuned


def tune_for_copies(device: torch.device, row_bytes: Iterable[int],
                    page_tokens: int) -> list[KeyResult]:
    """Build-time tuning of the gathers and scatters of rows of each size in ``row_bytes``
    with pages of ``page_tokens`` on ``device`` (nothing off CUDA or without
    ``KVMOVE_AUTOTUNE=1``)."""
    if device.type != "cuda" or not autotune_enabled():
        return []
    shapes = [(d, rb, page_tokens) for rb in dict.fromkeys(row_bytes)
              for d in ("gather", "scatter")]
    return tune_missing(gpu_name(device), device, shapes)
