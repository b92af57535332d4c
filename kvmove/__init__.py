"""kvmove: move KV-cache bytes between a GPU KV cache, layer-first pinned staging and the
Mooncake store. See docs/API.md for the contract.

The public names are loaded on first use (PEP 562), so that ``import kvmove.cli`` and
``kvmove --help`` do not import torch."""

from __future__ import annotations

import importlib
import sys
import types

# public name -> module that defines it
_EXPORTS = {
    "Descriptors": "kvmove.describe",
    "EmbeddedMaster": "kvmove.embedded_master",
    "KVCache": "kvmove.cache",
    "KVMoveError": "kvmove.errors",
    "KVMover": "kvmove.mover",
    "MooncakeStore": "kvmove.store",
    "StagingBuffer": "kvmove.staging",
    "StagingFull": "kvmove.errors",
    "Status": "kvmove.status",
    "StoreConfig": "kvmove.store_config",
    "StoreError": "kvmove.errors",
    "StoreResult": "kvmove.store",
    "Transfer": "kvmove.transfer",
    "copy_rows": "kvmove.copy",
    "describe": "kvmove.describe",
    "gather": "kvmove.copy",
    "scatter": "kvmove.copy",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmove' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """``kvmove.describe`` is the function, although a submodule has the same name: the
    import system binds the submodule on the package when it is first imported, and this
    property keeps the function in front (as the eager imports of earlier versions did)."""

    @property
    def describe(self):
        return importlib.import_module("kvmove.describe").describe

    @describe.setter
    def describe(self, value) -> None:
        pass


sys.modules[__name__].__class__ = _Package
