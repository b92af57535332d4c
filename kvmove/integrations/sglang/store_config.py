"""Where kvmove's SGLang backend finds its Mooncake store: the same sources, names and
defaults as SGLang's own Mooncake backend.

1. ``extra_config`` (``--hicache-storage-backend-extra-config``) with
   ``master_server_address``: the keys SGLang's backend reads there (``protocol``,
   ``device_name``, ``metadata_server``, ``global_segment_size``, ``local_hostname``);
2. else the JSON file named by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` (the same keys);
3. else the ``MOONCAKE_*`` environment variables (``MOONCAKE_MASTER``, ``MOONCAKE_PROTOCOL``,
   ``MOONCAKE_DEVICE``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``,
   ``MOONCAKE_LOCAL_HOSTNAME``).

SGLang's defaults apply where a value is not given: protocol ``rdma``, metadata server
``P2PHANDSHAKE``, a 4 GB global segment, local hostname ``localhost``. As in SGLang, the
global segment is shared by the ranks of one node: each rank contributes ``size / (tp_size *
pp_size)``.
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
}


def _from_mapping(values: Mapping, where: str) -> dict:
    out = {field: values[key] for key, field in _KEYS.items()
           if key in values and values[key] is not None}
    if "master_address" not in out:
        raise ValueError(f"{where} names no 'master_server_address'")
    if "protocol" not in out and os.environ.get("MOONCAKE_PROTOCOL", "").strip():
        out["protocol"] = os.environ["MOONCAKE_PROTOCOL"].strip()
    return out


def store_config_for(storage_config, environ: Mapping[str, str] | None = None) -> StoreConfig:
    """The :class:`kvmove.StoreConfig` for SGLang's ``HiCacheStorageConfig``."""
    env = os.environ if environ is None else environ
    extra = getattr(storage_config, "extra_config", None) or {}
    if extra.get("master_server_address"):
        values = _from_mapping(extra, "extra_config")
    elif env.get(CONFIG_PATH_VAR):
        path = env[CONFIG_PATH_VAR]
        with open(path) as f:
            values = _from_mapping(json.load(f), f"{CONFIG_PATH_VAR} file {path!r}")
    else:
        set_vars = {ENV_VARS[v] for v in ENV_VARS if env.get(v, "").strip()}
        defaults = {k: v for k, v in SGLANG_DEFAULTS.items() if k not in set_vars}
        values = dataclasses.asdict(StoreConfig.from_env(env, **defaults))
    for field, default in SGLANG_DEFAULTS.items():
        values.setdefault(field, default)
    ranks = max(1, int(getattr(storage_config, "tp_size", 1) or 1)
                * int(getattr(storage_config, "pp_size", 1) or 1))
    values["global_segment_size"] = parse_size(values["global_segment_size"],
                                               "global_segment_size") // ranks
    return StoreConfig(**values)
