"""A thin wrapper of Mooncake's ``TransferEngine``: the one place kvmove makes one, for the
direct path's writes into another process's pool (:mod:`kvmove.direct`) and the store's reads
of a live replica (:mod:`kvmove.store.replica_reader`). Settings come from the ``MOONCAKE_*``
variables; Mooncake's log is quiet and a write to a silent peer times out after 5 s unless the
user set ``MC_LOG_LEVEL`` / ``MC_TRANSFER_TIMEOUT``. Nothing reaches the engine before
``initialize`` succeeded or after :meth:`Engine.close`; every engine made beside others takes
a name of its own (:meth:`TransportSettings.named_apart`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kvmove.errors import KVMoveError
from kvmove.store.config import ENV_VARS, TRANSPORT_FIELDS, StoreConfig, check_transport
from kvmove.store.embedded_master import free_ports
from kvmove.store.native_log import native_stderr_captured

log = logging.getLogger(__name__)

# Mooncake variables set while an engine is made, unless the user set them.
ENGINE_ENV_DEFAULTS = {"MC_LOG_LEVEL": "ERROR", "MC_TRANSFER_TIMEOUT": "5"}
_env_lock = threading.Lock()
_STORE_DEFAULTS = {n: StoreConfig.__dataclass_fields__[n].default for n in TRANSPORT_FIELDS}


@dataclass(frozen=True)
class TransportSettings:
    """How an engine joins the network: ``local_hostname`` (the address peers reach it at),
    ``protocol``, ``rdma_devices``, ``metadata_server``. Defaults and checks are the
    store's (:class:`kvmove.StoreConfig`)."""

    local_hostname: str = _STORE_DEFAULTS["local_hostname"]
    protocol: str = _STORE_DEFAULTS["protocol"]
    rdma_devices: str = _STORE_DEFAULTS["rdma_devices"]
    metadata_server: str = _STORE_DEFAULTS["metadata_server"]

    def __post_init__(self):
        checked = check_transport({n: getattr(self, n) for n in TRANSPORT_FIELDS})
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides) -> TransportSettings:
        """Settings from the ``MOONCAKE_*`` variables; ``overrides`` (fields) that are not
        ``None`` win. A malformed value raises ``ValueError`` naming its variable."""
        env = os.environ if environ is None else environ
        values = {}
        for var, name in ENV_VARS.items():
            if name in TRANSPORT_FIELDS and (env.get(var) or "").strip():
                values[name] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValueError as e:
            var = next((v for v, n in ENV_VARS.items() if n in values and n not in overrides
                        and str(e).startswith(n)), None)
            if var is None:
                raise
            raise ValueError(f"environment variable {var}: {e}") from None

    @property
    def p2p(self) -> bool:
        return self.metadata_server.upper() == "P2PHANDSHAKE"

    @property
    def host(self) -> str:
        """``local_hostname`` without a ``:port`` (ignored under ``P2PHANDSHAKE``)."""
        name = self.local_hostname  # a name or IPv4 address, or [IPv6]; then maybe :port
        if name.startswith("["):
            return name[: name.index("]") + 1]
        return name.partition(":")[0]

    @property
    def has_port(self) -> bool:
        """Whether ``local_hostname`` names a port (``host:port``, ``[IPv6]:port``)."""
        return len(self.local_hostname) > len(self.host)

    def named_apart(self) -> TransportSettings:
        """These settings for one more engine in this process: the same under
        ``P2PHANDSHAKE`` (each engine gets its own port there); with a metadata server, the
        host with a free port of its own, so that its name (its key in the metadata server)
        is its own."""
        if self.p2p:
            return self
        port = free_ports("", 1)[0]  # free on every interface, whichever the host names
        return dataclasses.replace(self, local_hostname=f"{self.host}:{port}")


@contextlib.contextmanager
def _engine_env():
    """:data:`ENGINE_ENV_DEFAULTS` in the environment where the user set nothing, for the
    block only (Mooncake reads them when an engine is made)."""
    with _env_lock:
        added = [k for k in ENGINE_ENV_DEFAULTS if k not in os.environ]
        for k in added:
            os.environ[k] = ENGINE_ENV_DEFAULTS[k]
        try:
            yield
        finally:
            for k in added:
                os.environ.pop(k, None)


class Engine:
    """One initialized Mooncake ``TransferEngine``. ``peer``: the name other engines write
    to it by (``host:rpc_port`` under ``P2PHANDSHAKE``, else the host name, which names
    its segment in the metadata server). Raises :class:`kvmove.KVMoveError` when Mooncake
    is missing or the engine cannot be set up (nothing is left open then)."""

    def __init__(self, settings: TransportSettings):
        self.settings = settings
        with _engine_env():  # the log level is read when the module is first imported
            try:
                from mooncake.engine import TransferEngine
            except ImportError as e:
                raise KVMoveError(
                    "the Mooncake Python package is not installed (pip install "
                    "mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda on a "
                    f"machine without CUDA): {e}") from e
            with native_stderr_captured() as said:  # glog's set-up lines go to the logger
                engine = TransferEngine()
                rc = engine.initialize(settings.local_hostname, settings.metadata_server,
                                       settings.protocol, settings.rdma_devices)
        if rc != 0:
            raise KVMoveError(
                f"Mooncake TransferEngine.initialize({settings.local_hostname!r}, "
                f"{settings.metadata_server!r}, {settings.protocol!r}, "
                f"{settings.rdma_devices!r}) failed with code {rc}"
                + (f"; Mooncake said: {' | '.join(said[-3:])}" if said else ""))
        self._engine = engine
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> nbytes
        self.peer = (f"{settings.host}:{engine.get_rpc_port()}" if settings.p2p
                     else settings.local_hostname)

    @property
    def closed(self) -> bool:
        return self._engine is None

    def register(self, regions) -> None:
        """Register each ``(address, nbytes)`` not registered yet (RDMA needs it for every
        byte it reads or writes; over TCP it is what a receiver accepts writes into). A
        failure unregisters what this call registered and raises :class:`KVMoveError`."""
        with self._lock:
            if self._engine is None:
                raise KVMoveError("the transfer engine is closed")
            added = []
            for address, nbytes in regions:
                if self._registered.get(address) == nbytes:
                    continue
                rc = self._engine.register_memory(address, nbytes)
                if rc != 0:
                    for a in added:
                        self._engine.unregister_memory(a)
                        del self._registered[a]
                    raise KVMoveError(f"Mooncake register_memory({address:#x}, {nbytes}) "
                                      f"failed with code {rc} (an overlapping region is -7)")
                self._registered[address] = nbytes
                added.append(address)

    def unregister(self, address: int) -> None:
        """Undo the registration of the region starting at ``address`` (if registered)."""
        with self._lock:
            if self._engine is not None and self._registered.pop(address, None) is not None:
                rc = self._engine.unregister_memory(address)
                if rc != 0:
                    log.debug("unregister_memory(%#x) returned %d", address, rc)

    @property
    def registered(self) -> dict[int, int]:
        """``{address: nbytes}`` of the regions registered now (a copy)."""
        with self._lock:
            return dict(self._registered)

    def read(self, peer: str, dsts: list[int], srcs: list[int], lengths: list[int]) -> int:
        """``batch_transfer_sync_read``: read ``lengths[i]`` bytes at the peer's ``srcs[i]``
        into ``dsts[i]`` (registered here); 0 once every span is read, else a Mooncake code.
        Blocks: bound it (:func:`kvmove.store.bounded_call.call_bounded`)."""
        engine = self._engine
        if engine is None:
            return -1
        return engine.batch_transfer_sync_read(peer, dsts, srcs, lengths)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
        """``batch_transfer_sync_write``: 0 once every span is in the peer's memory, else a
        Mooncake code (-1). A failure does not cancel the spans (see the module doc)."""
        engine = self._engine
        if engine is None:
            return -1
        return engine.batch_transfer_sync_write(peer, srcs, dsts, lengths)

    def close(self) -> None:
        """Unregister everything and destroy the engine. Idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            for address in self._registered:
                rc = engine.unregister_memory(address)
                if rc != 0:
                    log.debug("unregister_memory(%#x) returned %d", address, rc)
            self._registered.clear()
        del engine  # the last reference: the destructor runs here

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Engine({self.peer}, {self.settings.protocol}, {state})"
