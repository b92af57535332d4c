"""Where the vLLM connector's Mooncake store is: the JSON file vLLM's own Mooncake connectors
read (``MOONCAKE_CONFIG_PATH``), else kvmove's ``MOONCAKE_*`` variables. vLLM is imported
only to find this node's IP (:func:`local_hostname`), as vLLM's own connector does."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from kvmove.store.config import DEFAULT_GLOBAL_SEGMENT_SIZE, StoreConfig, parse_size

# vLLM's defaults for fields its JSON leaves out (vllm/distributed/mooncake_store.py).
_VLLM_DEFAULT_PROTOCOL = "rdma"
_VLLM_DEFAULT_LOCAL_BUFFER_SIZE = 4 << 30
DEFAULT_TENANT_ID = "default"  # vLLM's (and Mooncake's) tenant of a client that names none


def _tenant_id(value, path: str) -> str:
    """vLLM's ``_normalize_tenant_id``: ``None`` or blank is ``"default"``, a string is
    stripped, anything else raises ``TypeError`` (as vLLM's does)."""
    if value is None:
        return DEFAULT_TENANT_ID
    if not isinstance(value, str):
        raise TypeError(f"MOONCAKE_CONFIG_PATH={path!r}: tenant_id must be a string or null, "
                        f"got {type(value).__name__}: {value!r}")
    return value.strip() or DEFAULT_TENANT_ID


def _override(value) -> str | None:
    """vLLM's ``normalize_string_override``: a non-blank string, stripped, else ``None``."""
    if not isinstance(value, str):
        return None
    return value.strip() or None


def _vllm_get_ip() -> str:
    try:
        from vllm.utils.network_utils import get_ip
    except ImportError:  # vLLM before utils/network_utils.py
        from vllm.utils import get_ip
    return get_ip()


def local_hostname(environ: Mapping[str, str] | None = None) -> str:
    """The address other clients reach this one's segment at, as vLLM's
    ``MooncakeStoreWorker`` resolves it (``rdma_utils.get_requester_local_hostname(get_ip())``):
    ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME``; else ``MOONCAKE_LOCAL_HOSTNAME`` (kvmove's
    variable, which vLLM does not read); else this node's IP as vLLM's ``get_ip()`` finds it
    (``VLLM_HOST_IP``, else the address of the default route)."""
    env = os.environ if environ is None else environ
    for var in ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_LOCAL_HOSTNAME"):
        value = _override(env.get(var))
        if value is not None:
            return value
    host_ip = env.get("VLLM_HOST_IP")  # get_ip() reads it from os.environ
    if host_ip:
        return host_ip
    return _vllm_get_ip()


def store_config_from_file(path: str, environ: Mapping[str, str] | None = None) -> StoreConfig:
    """A :class:`StoreConfig` from vLLM's Mooncake JSON (``master_server_address``,
    ``metadata_server``, ``protocol``, ``device_name``, ``mode``, ``global_segment_size``,
    ``local_buffer_size``, ``tenant_id``: the Mooncake tenant, resolved as vLLM's
    ``_normalize_tenant_id`` does: missing, ``null`` or blank is ``"default"``, a string is
    stripped, another type raises ``TypeError``; vLLM reads no ``MOONCAKE_TENANT_ID`` with
    the file, nor does this). The address other clients reach this one at is vLLM's
    (:func:`local_hostname`: ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME``, else
    ``MOONCAKE_LOCAL_HOSTNAME``, else this node's IP); ``KVMOVE_REPLICAS`` and
    ``KVMOVE_CALL_TIMEOUT`` set the replicas of every object and the bound on a store call,
    as for every kvmove store."""
    env = os.environ if environ is None else environ
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path!r}: cannot read a JSON object: {e}") \
            from None
    if not isinstance(raw, dict):
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path!r}: expected a JSON object")
    if not raw.get("master_server_address"):
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path!r}: 'master_server_address' is missing")
    tenant = _tenant_id(raw.get("tenant_id", DEFAULT_TENANT_ID), path)
    mode = raw.get("mode", "embedded")
    if mode not in ("embedded", "standalone-store"):
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path!r}: unknown mode {mode!r}")
    segment = (0 if mode == "standalone-store"
               else raw.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE))
    return StoreConfig(
        master_address=raw["master_server_address"],
        metadata_server=raw.get("metadata_server") or "P2PHANDSHAKE",
        protocol=raw.get("protocol", _VLLM_DEFAULT_PROTOCOL),
        rdma_devices=raw.get("device_name", ""),
        global_segment_size=parse_size(segment, "global_segment_size"),
        local_buffer_size=parse_size(
            raw.get("local_buffer_size", _VLLM_DEFAULT_LOCAL_BUFFER_SIZE), "local_buffer_size"),
        local_hostname=local_hostname(env),
        replicas=env.get("KVMOVE_REPLICAS", "").strip() or 1,
        call_timeout=env.get("KVMOVE_CALL_TIMEOUT", "").strip() or 10.0,
        tenant_id=tenant,
    )


def connector_store_config(environ: Mapping[str, str] | None = None) -> StoreConfig:
    """``MOONCAKE_CONFIG_PATH``'s file when set, else kvmove's ``MOONCAKE_*`` variables
    (``MOONCAKE_TENANT_ID`` among them: :meth:`kvmove.StoreConfig.from_env`)."""
    env = os.environ if environ is None else environ
    path = env.get("MOONCAKE_CONFIG_PATH")
    if path:
        return store_config_from_file(path, env)
    return StoreConfig.from_env(env)
