"""kvmove: move KV-cache bytes between a GPU KV cache, layer-first pinned staging and the
Mooncake store. See docs/API.md for the contract.

The public names are loaded on first use (PEP 562), so that ``import kvmove.cli`` and
``kvmove --help`` do not import torch."""

from __future__ import annotations

import importlib

from kvmove.rows.torch_backend import openmp_environ as _openmp_environ

_openmp_environ.watch()  # how torch's OpenMP threads wait, as torch loads (CPU copies)

# public name -> module that defines it
_EXPORTS = {
    "Descriptors": "kvmove.objects.descriptors",
    "EmbeddedMaster": "kvmove.store.embedded_master",
    "HostPool": "kvmove.memory.host_pool",
    "KVCache": "kvmove.memory.cache",
    "KVMoveError": "kvmove.errors",
    "KVMover": "kvmove.mover.kv_mover",
    "MooncakeStore": "kvmove.store.mooncake_store",
    "PageReceiver": "kvmove.direct.receiver",
    "PageSender": "kvmove.direct.sender",
    "PendingPut": "kvmove.store.mooncake_store",
    "PreparedPages": "kvmove.rows.prepared_pages",
    "StagingBuffer": "kvmove.memory.staging",
    "StagingFull": "kvmove.errors",
    "StagingInUse": "kvmove.errors",
    "Status": "kvmove.status",
    "StoreConfig": "kvmove.store.config",
    "StoreError": "kvmove.errors",
    "StoreResult": "kvmove.store.mooncake_store",
    "Transfer": "kvmove.mover.transfer",
    "copy_rows": "kvmove.rows.moves",
    "describe": "kvmove.objects.descriptors",
    "gather": "kvmove.rows.moves",
    "prepare_pages": "kvmove.rows.prepared_pages",
    "scatter": "kvmove.rows.moves",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule not imported yet (``kvmove.status.BAD_ROWS``)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'kvmove' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
