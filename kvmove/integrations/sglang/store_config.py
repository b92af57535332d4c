"""Where kvmove's SGLang backend finds its Mooncake store: the same sources, names and
defaults as SGLang's own Mooncake backend. First ``extra_config`` (with
``master_server_address``), else the JSON file named by
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, else the ``MOONCAKE_*`` variables; SGLang's
defaults (``rdma``, ``P2PHANDSHAKE``, a 4 GB segment shared by the node's ``tp_size *
pp_size`` ranks, ``localhost``), its local-hostname order, per-rank device map and tenant
rule. Standalone storage (a separate ``mooncake_client``) is a ``ValueError`` naming the
setting. See ``docs/API.md``, "SGLang".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from kvmove.store.config import ENV_VARS, StoreConfig, parse_size

CONFIG_PATH_VAR = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
SGLANG_DEFAULTS = {
    "protocol": "rdma",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 4 << 30,
    "local_hostname": "localhost",
}
# SGLang's extra_config / config file keys -> StoreConfig fields.
_KEYS = {
    "master_server_address": "master_address",
    "protocol": "protocol",
    "device_name": "rdma_devices",
    "metadata_server": "metadata_server",
    "global_segment_size": "global_segment_size",
    "local_hostname": "local_hostname",
    "tenant_id": "tenant_id",
}
# SGLang's settings for standalone storage (a separate mooncake_client serves the node).
_STANDALONE_KEYS = ("client_server_address", "standalone_storage")
# kvmove's own settings (no SGLang name): read from the environment for every source.
_KVMOVE_VARS = ("KVMOVE_REPLICAS", "KVMOVE_CALL_TIMEOUT")
_TRUE = ("true", "1", "yes", "y")  # SGLang's true values of a boolean variable
DEFAULT_TENANT_ID = "default"  # SGLang's (and Mooncake's) tenant of a client that names none


def _tenant_id(value) -> str:
    """SGLang's ``_normalize_tenant_id``: ``None`` or blank is ``"default"``; anything else
    is ``str(value)``, stripped."""
    if value is None:
        return DEFAULT_TENANT_ID
    return str(value).strip() or DEFAULT_TENANT_ID


def _local_hostname(environ: Mapping[str, str], configured) -> str:
    """SGLang's order: ``MOONCAKE_LOCAL_HOSTNAME``, ``LOCAL_HOSTNAME``, the configured value,
    ``localhost`` (so one extra_config can be shared by the nodes)."""
    for value in (environ.get("MOONCAKE_LOCAL_HOSTNAME"), environ.get("LOCAL_HOSTNAME")):
        if value and value.strip():
            return value
    return configured or SGLANG_DEFAULTS["local_hostname"]


def _rank_devices(devices, storage_config):
    """SGLang's per-rank device map: a JSON object ``{tp_rank: devices}`` gives this rank's
    entry (``""`` when it has none or the JSON is malformed); anything else is unchanged."""
    if not isinstance(devices, str) or not devices.strip().startswith("{"):
        return devices
    rank = getattr(storage_config, "tp_rank", None)
    try:
        table = json.loads(devices)
        return table.get(rank, "") or table.get(str(rank), "")
    except (json.JSONDecodeError, AttributeError):
        return ""


def _refuse_standalone(settings: dict, where: str) -> None:
    named = [name for name, value in settings.items() if value]
    if named:
        raise ValueError(
            f"{where} sets {' and '.join(named)}: kvmove's SGLang backend does not serve "
            f"Mooncake standalone storage (a separate mooncake_client); name the master "
            f"(master_server_address or MOONCAKE_MASTER) with standalone storage off"
        )


def _from_mapping(values: Mapping, where: str, environ: Mapping[str, str],
                  storage_config) -> dict:
    _refuse_standalone({key: values.get(key) for key in _STANDALONE_KEYS}, where)
    out = {field: values[key] for key, field in _KEYS.items()
           if key in values and values[key] is not None}
    if "master_address" not in out:
        raise ValueError(f"{where} names no 'master_server_address'")
    if "protocol" not in out and environ.get("MOONCAKE_PROTOCOL", "").strip():
        out["protocol"] = environ["MOONCAKE_PROTOCOL"].strip()
    out["rdma_devices"] = _rank_devices(out.get("rdma_devices", ""), storage_config)
    out["tenant_id"] = _tenant_id(out.get("tenant_id"))  # MOONCAKE_TENANT_ID is not read
    for var in _KVMOVE_VARS:  # kvmove's own knobs apply whatever the source (not SGLang's)
        if environ.get(var, "").strip():
            out[ENV_VARS[var]] = environ[var].strip()
    return out


def store_config_for(storage_config, environ: Mapping[str, str] | None = None) -> StoreConfig:
    """The :class:`kvmove.StoreConfig` for SGLang's ``HiCacheStorageConfig``. The tenant is
    the source's ``tenant_id`` (``MOONCAKE_TENANT_ID`` only in the environment source, as
    SGLang reads it there alone)."""
    env = os.environ if environ is None else environ
    extra = getattr(storage_config, "extra_config", None) or {}
    if any(extra.get(key) is not None for key in ("master_server_address",
                                                   "client_server_address")):
        values = _from_mapping(extra, "extra_config", env, storage_config)
    elif env.get(CONFIG_PATH_VAR):
        path = env[CONFIG_PATH_VAR]
        with open(path) as f:
            values = _from_mapping(json.load(f), f"{CONFIG_PATH_VAR} file {path!r}", env,
                                   storage_config)
    else:
        standalone = env.get("MOONCAKE_STANDALONE_STORAGE", "").strip().lower()
        _refuse_standalone({"MOONCAKE_CLIENT": env.get("MOONCAKE_CLIENT", "").strip(),
                            "MOONCAKE_STANDALONE_STORAGE": standalone in _TRUE},
                           "the environment")
        set_vars = {ENV_VARS[v] for v in ENV_VARS if env.get(v, "").strip()}
        overrides = {k: v for k, v in SGLANG_DEFAULTS.items() if k not in set_vars}
        overrides["rdma_devices"] = _rank_devices(env.get("MOONCAKE_DEVICE", ""), storage_config)
        overrides["tenant_id"] = _tenant_id(env.get("MOONCAKE_TENANT_ID"))
        values = dataclasses.asdict(StoreConfig.from_env(env, **overrides))
    values["local_hostname"] = _local_hostname(env, values.get("local_hostname"))
    for field, default in SGLANG_DEFAULTS.items():
        values.setdefault(field, default)
    ranks = max(1, int(getattr(storage_config, "tp_size", 1) or 1)
                * int(getattr(storage_config, "pp_size", 1) or 1))
    values["global_segment_size"] = parse_size(values["global_segment_size"],
                                               "global_segment_size") // ranks
    try:
        return StoreConfig(**values)
    except ValueError as e:  # a value of kvmove's own variables: name the variable
        var = next((v for v in _KVMOVE_VARS if str(e).startswith(ENV_VARS[v])
                    and env.get(v, "").strip()), None)
        if var is None:
            raise
        raise ValueError(f"environment variable {var}: {e}") from None
