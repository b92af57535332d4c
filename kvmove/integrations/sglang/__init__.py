"""kvmove as an SGLang HiCache storage backend, loaded by SGLang's ``"dynamic"`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvmove","module_path":"kvmove.integrations.sglang",
      "class_name":"KVMoveStorage","interface_v1":1}'

By role: :mod:`.backend` (``KVMoveStorage``, the class SGLang loads), :mod:`.keys`
(SGLang's store keys), :mod:`.pools` (SGLang's host pools as :class:`kvmove.HostPool`) and
:mod:`.store_config` (where the store is). Only :mod:`.backend` imports SGLang, and only
when used: ``kvmove.integrations.sglang.keys`` imports on any machine.
"""

from __future__ import annotations

import importlib

__all__ = ["KVMoveStorage"]


def __getattr__(name: str):
    if name != "KVMoveStorage":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.backend").KVMoveStorage
