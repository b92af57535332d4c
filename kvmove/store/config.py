"""``StoreConfig``: how to reach a Mooncake store, from code, a dict, or SGLang's environment
(the ``MOONCAKE_*`` variables SGLang reads, plus ``KVMOVE_REPLICAS`` and
``KVMOVE_CALL_TIMEOUT``), so an engine deployment that already talks to Mooncake works
unchanged. Sizes are byte counts or numbers with a unit (``"4gb"``, ``"512MB"``, ``"1.5g"``;
powers of 1024); a malformed value raises ``ValueError`` naming the variable and the value.
The fields, variables and defaults: ``docs/API.md``, ``StoreConfig``."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["TRANSPORT_FIELDS", "StoreConfig", "check_transport", "parse_size"]

DEFAULT_GLOBAL_SEGMENT_SIZE = 4 << 30  # SGLang's default
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20  # SGLang's: the zero-copy API needs no local buffer
# The transports Mooncake 0.3.13 knows (its store.so); a typo must fail before anything waits.
PROTOCOLS = ("tcp", "rdma", "nvlink", "nvlink_intra", "efa", "cxl", "hip", "barex", "ascend",
             "nvmeof", "ubshmem")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.ASCII)
MAX_SIZE = (1 << 63) - 1  # what Mooncake's int64/size_t arguments can hold

# Hosts: a name or IPv4 address, or an IPv6 address in brackets; ASCII only.
# (All of these are used with fullmatch: ``$`` would also match before a final newline.)
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+(?:%\w+)?\]",
                   re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)
_NO_SPACE_OR_CONTROL = re.compile(r"[^\s\x00-\x1f\x7f]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Environment variable -> field.
ENV_VARS = {
    "MOONCAKE_MASTER": "master_address",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "rdma_devices",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "KVMOVE_REPLICAS": "replicas",
    "KVMOVE_CALL_TIMEOUT": "call_timeout",
    "MOONCAKE_TENANT_ID": "tenant_id",
}

DEFAULT_TENANT_ID = "default"

# Mooncake's own JSON config names (MOONCAKE_CONFIG_PATH files) -> field.
_ALIASES = {"master_server_address": "master_address", "device_name": "rdma_devices",
            "replica_count": "replicas", "replica_num": "replicas"}


def parse_size(value, name: str = "size") -> int:
    """A byte count from an int or a string such as ``"4gb"``; ``ValueError`` naming
    ``name`` when it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float) and value.is_integer():
        result = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value.lower())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(
                f"{name} = {value!r} is not a size; use bytes or a number with a unit "
                f"(e.g. 4294967296, '4gb', '512mb')"
            )
        exact = Fraction(m.group(1)) * _UNITS[m.group(2)]
        if exact.denominator != 1 and _UNITS[m.group(2)] == 1:
            raise ValueError(f"{name} = {value!r} is not a whole number of bytes")
        result = int(exact)
    else:
        raise ValueError(f"{name} must be a byte count, got {type(value).__name__} {value!r}")
    if result < 0:
        raise ValueError(f"{name} = {value!r} must not be negative")
    if result > MAX_SIZE:
        raise ValueError(f"{name} = {value!r} is larger than {MAX_SIZE} bytes")
    return result


def _parse_address(value, name: str) -> str:
    """``value`` stripped, after checking it is ``host:port`` (a host name or IPv4 address,
    or an IPv6 address in brackets; a port 1..65535)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a 'host:port' string, got {value!r}")
    host, sep, port = value.strip().rpartition(":")
    if (not sep or not _HOST.fullmatch(host) or not _PORT.fullmatch(port)
            or not 0 < int(port) < 65536):
        raise ValueError(
            f"{name} = {value!r} is not a 'host:port' address (a host name or IPv4 address, "
            f"or [IPv6] in brackets, then a port 1..65535; no scheme, path or spaces)"
        )
    return value.strip()


def _seconds(value, name: str) -> float:
    """``value`` as float seconds, after checking it is a positive number a thread can wait
    for (at most ``threading.TIMEOUT_MAX``; ``inf`` would overflow the waits)."""
    try:
        seconds = -1.0 if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"{name} must be positive seconds, at most {threading.TIMEOUT_MAX:g}, got {value!r}"
        )
    return seconds


# The fields that say how a Transfer Engine joins the network (the store's and the direct
# path's, kvmove.direct): checked by check_transport.
TRANSPORT_FIELDS = ("metadata_server", "protocol", "local_hostname", "rdma_devices")


def check_transport(values: Mapping) -> dict:
    """The transport fields of ``values`` (:data:`TRANSPORT_FIELDS`), stripped and checked:
    ``metadata_server``, ``protocol`` and ``local_hostname`` non-empty strings, the protocol
    a transport name (lower-cased), the host name a host or IP address (optionally
    ``:port``), ``rdma_devices`` a string (``None`` is ``""``); no spaces or control
    characters in the metadata server or the devices. ``ValueError`` names the field."""
    out = {}
    for name in ("metadata_server", "protocol", "local_hostname"):
        value = values[name]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        out[name] = value.strip()
    out["protocol"] = out["protocol"].lower()
    if out["protocol"] not in PROTOCOLS:
        close = difflib.get_close_matches(out["protocol"], PROTOCOLS, n=1)
        raise ValueError(
            f"protocol must be a Mooncake transport ({', '.join(PROTOCOLS)}), got "
            f"{out['protocol']!r}" + (f"; did you mean {close[0]!r}?" if close else "")
        )
    host = out["local_hostname"]
    name, _, port = host.rpartition(":")
    if not _HOST.fullmatch(host) and not (_HOST.fullmatch(name) and _PORT.fullmatch(port)):
        raise ValueError(
            f"local_hostname must be a host name or IP address (optionally ':port'), "
            f"got {host!r}"
        )
    devices = "" if values["rdma_devices"] is None else values["rdma_devices"]
    if not isinstance(devices, str):
        raise ValueError(f"rdma_devices must be a string, got {devices!r}")
    out["rdma_devices"] = devices.strip()
    for name in ("metadata_server", "rdma_devices"):
        if not _NO_SPACE_OR_CONTROL.fullmatch(out[name]):
            raise ValueError(
                f"{name} must not contain spaces or control characters, got {out[name]!r}"
                + (" (list devices as 'mlx5_0,mlx5_1')" if name == "rdma_devices" else "")
            )
    return out


@dataclass(frozen=True)
class StoreConfig:
    """Where the Mooncake store is and how this client joins it: ``master_address``,
    ``metadata_server``, ``protocol``, ``rdma_devices``, ``local_hostname``,
    ``global_segment_size``, ``local_buffer_size``, ``replicas``, ``tenant_id`` (Mooncake's), and
    kvmove's own ``connect_timeout``, ``max_batch_keys``, ``detect_exists``, ``call_timeout``,
    ``max_call_spans``, ``max_inflight_spans``. Each field: ``docs/API.md``, ``StoreConfig``."""

    master_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str = "localhost"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    replicas: int = 1
    connect_timeout: float = 5.0
    max_batch_keys: int = 1024
    detect_exists: bool = True
    call_timeout: float = 10.0
    max_call_spans: int | None = None
    max_inflight_spans: int | None = None
    tenant_id: str = DEFAULT_TENANT_ID

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "master_address", _parse_address(self.master_address, "master_address"))
        transport = check_transport({n: getattr(self, n) for n in TRANSPORT_FIELDS})
        for name, value in transport.items():
            set_(self, name, value)
        for name in ("global_segment_size", "local_buffer_size"):
            set_(self, name, parse_size(getattr(self, name), name))
        for name in ("replicas", "max_batch_keys"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            set_(self, name, value)
        set_(self, "connect_timeout", _seconds(self.connect_timeout, "connect_timeout"))
        if not isinstance(self.detect_exists, bool):
            raise ValueError(f"detect_exists must be a bool, got {self.detect_exists!r}")
        set_(self, "call_timeout", _seconds(self.call_timeout, "call_timeout"))
        tenant = DEFAULT_TENANT_ID if self.tenant_id is None else self.tenant_id
        if not isinstance(tenant, str) or _CONTROL.search(tenant):
            raise ValueError(f"tenant_id must be a string without control characters (or "
                             f"None), got {self.tenant_id!r}")
        set_(self, "tenant_id", tenant.strip() or DEFAULT_TENANT_ID)
        for name in ("max_call_spans", "max_inflight_spans"):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
            set_(self, name, value)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the configuration fields."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping) -> StoreConfig:
        """A config from a mapping of field names (Mooncake's JSON names
        ``master_server_address`` and ``device_name`` are accepted too). An unknown name
        raises ``ValueError`` naming it."""
        if not isinstance(values, Mapping):
            raise TypeError(f"expected a mapping of config fields, got {type(values).__name__}")
        known = set(cls.fields())
        kwargs = {}
        for key, value in values.items():
            name = _ALIASES.get(key, key)
            if name not in known:
                raise ValueError(f"unknown store config field {key!r}; fields are {sorted(known)}")
            kwargs[name] = value
        if "master_address" not in kwargs:
            raise ValueError("store config needs 'master_address' ('host:port' of the master)")
        return cls(**kwargs)

    @classmethod
    def coerce(cls, config: StoreConfig | Mapping) -> StoreConfig:
        """``config`` itself, or a config built from a dict with the same fields."""
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        raise TypeError(f"expected a StoreConfig or a dict, got {type(config).__name__}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> StoreConfig:
        """A config from SGLang's ``MOONCAKE_*`` environment variables (see the module
        docstring); ``overrides`` set fields directly. ``MOONCAKE_MASTER`` is required. A
        malformed value raises ``ValueError`` naming the variable and the value."""
        unknown = set(overrides) - set(cls.fields())
        if unknown:
            raise ValueError(f"unknown store config field(s) {sorted(unknown)}")
        env = os.environ if environ is None else environ
        values: dict = {}
        for var, name in ENV_VARS.items():
            raw = env.get(var)
            if raw is not None and not isinstance(raw, str):
                raise ValueError(f"environment variable {var} must be a string, got {raw!r}")
            if raw is not None and raw.strip():
                values[name] = cls._parse_env(name, raw, var)
        values.update(overrides)
        if "master_address" not in values:
            raise ValueError(
                "environment variable MOONCAKE_MASTER is not set; set it to the Mooncake "
                "master's 'host:port' (or use MooncakeStore.embedded() for a local store)"
            )
        try:
            return cls(**values)
        except ValueError as e:  # a field's check: name its variable
            var = next((v for v, n in ENV_VARS.items()
                        if str(e).startswith(n) and n not in overrides), None)
            if var is None:
                raise
            raise ValueError(f"environment variable {var}: {e}") from None

    @staticmethod
    def _parse_env(name: str, raw: str, var: str):
        if name in ("global_segment_size", "local_buffer_size"):
            return parse_size(raw, var)
        if name == "master_address":
            return _parse_address(raw, var)
        return raw.strip()

    @property
    def replica_count(self) -> int:
        """The same as ``replicas`` (its earlier name)."""
        return self.replicas

    def replace(self, **changes) -> StoreConfig:
        """A copy with ``changes`` applied (validated)."""
        changes = {_ALIASES.get(k, k): v for k, v in changes.items()}
        unknown = set(changes) - set(self.fields())
        if unknown:
            raise ValueError(f"unknown store config field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)
