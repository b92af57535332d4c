"""Reading an object from a replica of one's choice: what replica failover needs and Mooncake
0.3.13's client does not do.

Mooncake 0.3.13's get reads only the *first* replica the master lists for a key; there is
no fallback inside a call, no way to exclude a segment or pick a replica, and the master
keeps listing a dead holder's replica as ``COMPLETE`` until its client TTL has passed. What
it does allow (measured on 0.3.13.post1):

- ``batch_get_replica_desc(keys)`` lists each key's replicas with the holder's transport
  endpoint, the object's address in the holder's segment and its size; the object is
  contiguous there. The endpoint is the holder's segment name: with the peer-to-peer
  handshake the ``host:port`` its Transfer Engine listens on; through a metadata server
  (``MOONCAKE_TE_META_DATA_SERVER``) a name the server resolves, not an address to probe;
- a TCP connect to a killed holder's endpoint (peer-to-peer handshake) is refused in well
  under a millisecond (a stopped one still accepts: a stall cannot be told from a probe);
- a Transfer Engine of one's own (``mooncake.engine.TransferEngine``, peer-to-peer
  handshake) reads the live replica's bytes straight into registered memory
  (``batch_transfer_sync_read``).

A direct read bypasses the store's lease, so :class:`kvmove.MooncakeStore` leases the keys
first (``batch_is_exist``) and confirms afterwards that the replica it read is still listed
at the same address with the same size.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from kvmove.errors import KVMoveError, StoreError
from kvmove.store.transfer_engine import Engine, TransportSettings

log = logging.getLogger(__name__)

__all__ = ["EndpointProbe", "Replica", "ReplicaReader", "replicas_of"]


@dataclass(frozen=True)
class Replica:
    """One memory replica of an object: the holder's transport ``endpoint``, the object's
    ``address`` in the holder's segment, its ``size`` and whether it is ``complete``."""

    endpoint: str
    address: int
    size: int
    complete: bool


def replicas_of(descriptors) -> list[Replica]:
    """The memory replicas in Mooncake's ``ReplicaDescriptor`` list, in the master's order
    (the first is the one a get reads)."""
    out = []
    for r in descriptors or ():
        try:
            if not r.is_memory_replica():
                continue
            buf = r.get_memory_descriptor().buffer_descriptor
            out.append(Replica(str(buf.transport_endpoint), int(buf.buffer_address),
                               int(buf.size), str(r.status).endswith("COMPLETE")))
        except Exception as e:  # a descriptor of another shape: skip it, say so
            log.debug("unreadable replica descriptor %r: %s", r, e)
    return out


class EndpointProbe:
    """Whether a holder's transport endpoint accepts TCP connections (a killed holder's is
    refused at once). Answers are kept ``ttl`` seconds."""

    def __init__(self, timeout: float = 0.3, ttl: float = 1.0):
        self.timeout, self.ttl = timeout, ttl
        self._seen: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def alive(self, endpoint: str) -> bool:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(endpoint)
        if seen is not None and now - seen[0] < self.ttl:
            return seen[1]
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout):
                alive = True
        except (OSError, ValueError):
            alive = False
        with self._lock:
            self._seen[endpoint] = (time.monotonic(), alive)
        if not alive:
            log.info("holder endpoint %s refuses connections: treating its replicas as lost",
                     endpoint)
        return alive


class ReplicaReader:
    """A Transfer Engine of the store's own (:class:`kvmove.store.transfer_engine.Engine`)
    that reads replicas directly into registered memory (the same regions the store
    registered). Thread-safe."""

    def __init__(self, *, local_hostname: str, metadata_server: str, protocol: str,
                 rdma_devices: str):
        settings = TransportSettings(local_hostname=local_hostname,
                                     metadata_server=metadata_server, protocol=protocol,
                                     rdma_devices=rdma_devices)
        # A replica's endpoint is its holder's address (one to probe) only with the
        # peer-to-peer handshake; through a metadata server it is a name the server resolves.
        self.endpoints_are_addresses = settings.p2p
        try:
            self._engine = Engine(settings.named_apart())  # beside the store's own client
        except KVMoveError as e:
            raise StoreError(f"no transfer engine for replica reads: {e}") from e
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def register(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)`` (a region registered at that address
        with another size is registered again)."""
        with self._lock:
            known = self._engine.registered.get(address)
            if known == nbytes:
                return
            if known is not None:
                self._engine.unregister(address)
            try:
                self._engine.register([(address, nbytes)])
            except KVMoveError as e:
                raise StoreError(f"replica reader: {e}") from e

    def unregister(self, address: int) -> None:
        self._engine.unregister(address)

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside one registered region."""
        return any(a <= ptr and ptr + nbytes <= a + n
                   for a, n in self._engine.registered.items())

    def read(self, endpoint: str, local: list[int], remote: list[int], lengths: list[int]
             ) -> int:
        """Read ``lengths[i]`` bytes at ``remote[i]`` of the holder at ``endpoint`` into
        ``local[i]``; Mooncake's code (0 = every span read). Blocks; bound it
        (:func:`kvmove.store.bounded_call.call_bounded`)."""
        return self._engine.read(endpoint, local, remote, lengths)

    def close(self) -> None:
        """Unregister everything and destroy the engine."""
        self._engine.close()
