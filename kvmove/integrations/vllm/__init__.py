"""kvmove as a vLLM KV connector (V1), loaded by module path::

    --kv-transfer-config '{"kv_connector":"KVMoveConnector",
        "kv_connector_module_path":"kvmove.integrations.vllm","kv_role":"kv_both"}'

By role: :mod:`.connector` (the class vLLM loads), :mod:`.scheduler` and :mod:`.worker`
(its two sides), :mod:`.plan` (what both sides agree on), :mod:`.metadata` (one step's
loads and saves), :mod:`.keys` (vLLM's store keys), :mod:`.layout` (vLLM's KV cache as
block regions) and :mod:`.store_config` (where the store is). Only the first four import
vLLM, and only when used: ``kvmove.integrations.vllm.keys`` imports on any machine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"KVMoveConnector": "connector", "KVMoveConnectorMetadata": "metadata"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
