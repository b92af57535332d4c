"""Replica failover: a key whose get failed in transport (``-800``: its first-listed
replica's holder is dead) and that has another complete replica on a live holder is read
from that replica, directly, within the same call (:class:`Failover`). Mooncake 0.3.13's get
reads only the first replica the master lists, with no fallback and no way to pick one, and
the master lists a dead holder's replica as ``COMPLETE`` until its client TTL has passed.
A direct read bypasses the store's lease: the keys are leased first (``batch_is_exist``) and
a key counts ``OK`` only when the replica read is still listed, same address and size,
afterwards. See ``docs/API.md``, "The store".
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmove.errors import KVMoveError, StoreError
from kvmove.metrics import record as metrics
from kvmove.status import CALL_TIMEOUT, TRANSFER_FAIL
from kvmove.store.bounded_call import call_bounded, settled
from kvmove.store.transfer_engine import Engine, TransportSettings

if TYPE_CHECKING:
    from concurrent.futures import Future

    from kvmove.objects.descriptors import Descriptors
    from kvmove.store.clients import ClientState
    from kvmove.store.config import StoreConfig
    from kvmove.store.transport_limits import TransportLimits

log = logging.getLogger(__name__)

__all__ = ["EndpointProbe", "Failover", "Replica", "ReplicaReader", "replicas_of"]


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


class Failover:
    """The store's replica failover (module docstring). Its reader is made on first use with
    every region registered in ``state`` (and kept in ``state.reader``, where registration
    keeps it up to date and the store's close closes it); made again 30 s after a failure."""

    def __init__(self, config: StoreConfig, limits: TransportLimits, state: ClientState):
        self.config, self.limits, self.state = config, limits, state
        self._probe = EndpointProbe()
        self._failed_at = -1e9

    def reader(self) -> ReplicaReader | None:
        state = self.state
        if state.reader is not None:
            return state.reader
        if time.monotonic() - self._failed_at < 30.0:
            return None
        with state.register_lock:
            if state.reader is None:
                try:
                    reader = ReplicaReader(
                        local_hostname=self.config.local_hostname,
                        metadata_server=self.config.metadata_server,
                        protocol=self.config.protocol, rdma_devices=self.config.rdma_devices)
                    for address, nbytes in state.registered.items():
                        reader.register(address, nbytes)
                except Exception as e:
                    log.warning("replica failover unavailable: %s", e)
                    self._failed_at = time.monotonic()
                    return None
                state.reader = reader
        return state.reader

    def run(self, client, desc: Descriptors, codes: list[int], bounded: Callable
            ) -> Future | None:
        """Read each key of ``desc`` whose get code is ``TRANSFER_FAIL`` from another live
        replica into its own spans, setting its code to the object size once read and
        confirmed (``CALL_TIMEOUT`` for a read that timed out). ``bounded``: the store's
        bounded master call. Returns the future of reads that timed out, or None."""
        idx = [i for i, c in enumerate(codes) if c == TRANSFER_FAIL]
        reader = self.reader()
        if reader is None or not idx:
            return None
        t0 = time.monotonic()
        keys = [desc.keys[i] for i in idx]
        leased = bounded(client.batch_is_exist, keys)  # a read leases the keys
        if not leased.done:  # the master is stuck: listing would wait as long again
            log.warning("replica failover: the master did not answer for %d keys within the "
                        "bound; not tried", len(keys))
            return None
        listed = bounded(client.batch_get_replica_desc, keys)
        if not listed.done or listed.error is not None:
            log.warning("replica failover: could not list the replicas of %d keys (%s)",
                        len(keys), listed.error or "no answer")
            return None
        plan: dict[str, list] = {}
        probing = reader.endpoints_are_addresses
        for i, key in zip(idx, keys, strict=True):
            size = desc.nbytes(i)
            found = [r for r in replicas_of(listed.value.get(key)) if r.complete
                     and r.size == size]
            # The first-listed replica is the one the get read: try the others first (where
            # endpoints can be probed, the first whose holder accepts connections).
            choice = next((r for r in found[1:] + found[:1]
                           if not probing or self._probe.alive(r.endpoint)), None)
            if choice is not None and all(reader.covers(p, n) for p, n in
                                          zip(desc.ptrs[i], desc.sizes[i], strict=True)):
                plan.setdefault(choice.endpoint, []).append((i, choice))
        read, late = [], []
        deadline = t0 + self.config.call_timeout
        for endpoint, items in plan.items():
            for group in self._groups(desc, items):
                local, remote, lengths = [], [], []
                for i, replica in group:
                    offset = replica.address
                    for ptr, n in zip(desc.ptrs[i], desc.sizes[i], strict=True):
                        local.append(ptr)
                        remote.append(offset)
                        lengths.append(n)
                        offset += n
                out = call_bounded(reader.read, endpoint, local, remote, lengths,
                                   timeout=deadline - time.monotonic())
                if not out.done:  # its spans may still be written: never read them again
                    late.append(out.late)
                    for i, _ in group:
                        codes[i] = CALL_TIMEOUT
                    log.warning("replica failover: a read of %d spans from %s gave no answer "
                                "by the bound", len(local), endpoint)
                elif out.error is None and out.value == 0:
                    read += group
                else:
                    log.warning("replica failover: reading %d keys from %s failed (%s)",
                                len(group), endpoint, out.error or out.value)
        if read:
            confirm = bounded(client.batch_get_replica_desc, [desc.keys[i] for i, _ in read])
            if confirm.done and confirm.error is None:
                for i, replica in read:
                    if replica in replicas_of(confirm.value.get(desc.keys[i])):
                        codes[i] = replica.size
        recovered = sum(1 for i in idx if codes[i] == desc.nbytes(i))
        metrics.failover(len(idx), recovered)
        # Nothing to say where no key had a replica to try (a failed transfer with one
        # replica, or an object of another size than its destination).
        log.log(logging.WARNING if plan else logging.DEBUG,
                "replica failover: %d of %d keys whose holder failed read from a live "
                "replica in %.2f s", recovered, len(idx), time.monotonic() - t0)
        return settled(late)

    def _groups(self, desc: Descriptors, items: list) -> list[list]:
        """``items`` ((key index, replica) for one holder) in groups of at most
        ``limits.call_spans`` spans."""
        groups, group, spans = [], [], 0
        for item in items:
            n = len(desc.ptrs[item[0]])
            if group and spans + n > self.limits.call_spans:
                groups.append(group)
                group, spans = [], 0
            group.append(item)
            spans += n
        if group:
            groups.append(group)
        return groups
