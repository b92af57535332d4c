"""``MooncakeStore``: zero-copy put/get of staging pages through a Mooncake store.

Every call returns one :class:`kvmove.Status` per key, in key order, as a
:class:`~kvmove.StoreResult`; a store failure is a per-key status, never an exception that
loses the other keys' results. Batches are cut here to what the transport carries
(:mod:`kvmove.store.transport_limits`) and their calls run one after the other; every
Mooncake call is bounded by ``config.call_timeout``.

The contract (statuses per call, bounds, threads, a master that restarts): ``docs/API.md``,
"The store". The parts: :mod:`.results` (statuses), :mod:`.master_probe` (opening a client),
:mod:`.clients` (bounded calls, client replacement), :mod:`.registration` (regions),
:mod:`.pending_put` (the exists check and the put), :mod:`.replica_reader` (failover).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvmove.objects.descriptors import Descriptors, check_keys
from kvmove.status import (
    CALL_TIMEOUT,
    CLIENT_EXCEPTION,
    INVALID_PARAMS,
    LEASE_EXPIRED,
    OBJECT_ALREADY_EXISTS,
    TRANSFER_FAIL,
    Status,
    code_name,
)
from kvmove.store.bounded_call import (
    default_runner,
    settled,
    start_call,
    start_call_threads,
    wait_until_returned,
)
from kvmove.store.clients import DATA_CALLS, Clients, shutdown
from kvmove.store.config import StoreConfig
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S, EmbeddedMaster
from kvmove.store.master_probe import open_client
from kvmove.store.pending_put import PendingPut, check_then_put
from kvmove.store.registration import Registrations
from kvmove.store.replica_reader import Failover, Replica, replicas_of
from kvmove.store.results import (
    UNREACHABLE,
    Codes,
    StoreResult,
    batch_codes,
    check_desc,
    get_status,
    log_outcome,
    put_statuses,
    remove_statuses,
    stops_the_call,
    stored_late,
    unreachable,
)
from kvmove.store.transport_limits import TransportLimits, limits_for

log = logging.getLogger(__name__)

__all__ = ["EMBEDDED_DEFAULTS", "MooncakeStore", "PendingPut", "StoreResult"]


# What embedded() sets unless overridden: a TCP client of the private master.
EMBEDDED_DEFAULTS = {
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "rdma_devices": "",
    "local_hostname": "127.0.0.1",
    "global_segment_size": 1 << 30,
    "local_buffer_size": 16 << 20,
}


# -- chunking ----------------------------------------------------------------------------------
def key_chunks(n: int, step: int) -> list[slice]:
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def span_chunks(desc: Descriptors, step: int, limits: TransportLimits) -> list[slice]:
    """Consecutive keys of ``desc`` cut into calls of at most ``step`` keys,
    ``limits.call_spans`` spans and ``limits.call_bytes`` bytes (a larger key goes alone)."""
    n, cap, most = len(desc), limits.call_spans, limits.call_bytes
    if n == 0:
        return []
    if n <= step and desc.num_spans <= cap and desc.total_bytes <= most:
        return [slice(0, n)]
    spans = np.cumsum(np.fromiter(map(len, desc.ptrs), dtype=np.int64, count=n))
    nbytes = np.cumsum(np.asarray(desc.object_sizes(), dtype=np.int64))
    chunks, start, base_spans, base_bytes = [], 0, 0, 0
    while start < n:
        end = min(int(np.searchsorted(spans, base_spans + cap, side="right")),
                  int(np.searchsorted(nbytes, base_bytes + most, side="right")))
        end = max(start + 1, min(end, start + step, n))
        chunks.append(slice(start, end))
        base_spans, base_bytes, start = int(spans[end - 1]), int(nbytes[end - 1]), end
    return chunks


def run_chunks(chunks: list[slice], run: Callable[[slice], list[int]],
               limits: TransportLimits, address: str) -> Codes:
    """The per-key codes of ``run(chunk)`` over ``chunks``, with the futures of calls that
    timed out joined in ``late``. Chunks run in order, ``limits.side_by_side`` at a time, as
    far as the client's spans in flight allow. Once a chunk finds the master unreachable or
    a call timed out, the chunks not started yet get that code untried."""
    if len(chunks) == 1:  # the usual case: one call, on this thread, nothing untried
        part = run(chunks[0])
        return Codes(part, settled([getattr(part, "late", None)]),
                     getattr(part, "late_puts", ()))
    n = chunks[-1].stop if chunks else 0
    width = min(len(chunks), limits.side_by_side,
                max(1, limits.inflight_spans // limits.call_spans))
    parts: list = [None] * len(chunks)
    taken = iter(range(len(chunks)))
    lock = threading.Lock()
    stop: list[int] = []  # the code that stops the call, once one chunk gave it

    def work() -> None:  # run chunks, in order, until none is left or one stops the call
        while True:
            with lock:
                k = next(taken, None)
                if k is None or stop:
                    return
            part = parts[k] = run(chunks[k])
            if stops_the_call(part):
                with lock:
                    stop.append(part[0] if unreachable(part) else CALL_TIMEOUT)
                return

    helpers = [default_runner().submit(work) for _ in range(width - 1)]
    try:
        work()  # this thread is one of the ``width`` workers
    finally:  # interrupted: the helpers' calls use the memory too
        wait_until_returned(*helpers)  # each chunk's calls are bounded, so this is too
    for helper in helpers:
        helper.result()
    codes: list[int] = []
    for chunk, part in zip(chunks, parts, strict=True):
        if part is None:  # not tried: the call stopped first
            part = [stop[0]] * (chunk.stop - chunk.start)
        codes += part
    if stop and any(p is None for p in parts):
        untried = sum(c.stop - c.start for c, p in zip(chunks, parts, strict=True) if p is None)
        log.warning("%s; %d keys not tried", f"master {address} unreachable "
                    f"({code_name(stop[0])})" if stop[0] != CALL_TIMEOUT else
                    "a Mooncake call timed out", untried)
    assert len(codes) == n
    return Codes(codes, settled(getattr(p, "late", None) for p in parts),
                 [lp for p in parts for lp in getattr(p, "late_puts", ())])


def _replace_later(store_ref: weakref.ref, old) -> None:
    """The client replacement a timed-out data call starts (through the store, whose
    ``_replace_client`` a test may stand in for)."""
    store = store_ref()
    if store is not None:
        store._replace_client(old)


class MooncakeStore:
    """A Mooncake store client for kvmove descriptors. ``MooncakeStore(config)`` joins an
    existing store (``config``: a :class:`~kvmove.StoreConfig` or a dict of its fields);
    :meth:`from_env` reads SGLang's ``MOONCAKE_*`` variables; :meth:`embedded` starts a
    private master on loopback first. Use as a context manager, or call :meth:`close`.
    Implements :class:`kvmove.store.protocol.Store`; the contract: ``docs/API.md``."""

    def __init__(self, config: StoreConfig | Mapping, *, _master: EmbeddedMaster | None = None):
        self.config = StoreConfig.coerce(config)
        client = open_client(self.config, _master)
        self.limits = limits_for(self.config.protocol, call_spans=self.config.max_call_spans,
                                 inflight_spans=self.config.max_inflight_spans)
        ref = weakref.ref(self)
        self._clients = Clients(self.config, self.limits, client, _master,
                                lambda old: _replace_later(ref, old))
        self._state = self._clients.state
        self._regions = Registrations(self._state)
        self._failovers = Failover(self.config, self.limits, self._state)
        self._bounded = self._clients.bounded  # an attribute: tests stand in for it
        self._finalizer = weakref.finalize(self, shutdown, self._state)
        log.debug("store limits: %s", self.limits)
        from mooncake.store import ReplicateConfig

        self._replicate = ReplicateConfig()
        self._replicate.replica_num = self.config.replicas
        # The threads its calls run on start now, not in the first calls (~0.1 ms each): one
        # for a put and one for a get at a time (an engine's saving and loading threads),
        # or as many as a call runs side by side, and the watchdog.
        start_call_threads(max(2, self.limits.side_by_side))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> MooncakeStore:
        """A store configured by SGLang's ``MOONCAKE_*`` environment variables
        (:meth:`kvmove.StoreConfig.from_env`)."""
        return cls(StoreConfig.from_env(environ, **overrides))

    @classmethod
    def embedded(cls, *, kv_lease_ttl_ms: int | None = None,
                 client_ttl_s: int | None = DEFAULT_CLIENT_TTL_S, master_args: Sequence[str] = (),
                 **overrides) -> MooncakeStore:
        """Start a private ``mooncake_master`` on free loopback ports and join it over TCP
        (``P2PHANDSHAKE``); ``close()`` stops the master. ``overrides`` set
        :class:`~kvmove.StoreConfig` fields (defaults: ``EMBEDDED_DEFAULTS``);
        ``kv_lease_ttl_ms``, ``client_ttl_s`` and ``master_args`` go to the master
        (:class:`kvmove.EmbeddedMaster`). Other processes join it with
        ``MooncakeStore(StoreConfig(master_address=store.address))``."""
        if "master_address" in overrides:
            raise ValueError("embedded() starts its own master; do not pass master_address")
        values = {**EMBEDDED_DEFAULTS, **overrides}
        StoreConfig.from_dict({**values, "master_address": "127.0.0.1:1"})  # validate first
        # Private to this store, its objects go with it: killed at close, not asked to stop
        # (Mooncake's master takes 1 s to exit after SIGTERM).
        master = EmbeddedMaster(kv_lease_ttl_ms=kv_lease_ttl_ms, client_ttl_s=client_ttl_s,
                                extra_args=master_args, stop_timeout=0)
        try:
            return cls(StoreConfig.from_dict({**values, "master_address": master.address}),
                       _master=master)
        except BaseException:
            master.stop()
            raise

    # -- state -----------------------------------------------------------------------------
    @property
    def master(self) -> EmbeddedMaster | None:
        """The embedded master this store started, or ``None``."""
        return self._state.master

    @property
    def address(self) -> str:
        return self.config.master_address

    @property
    def transport(self) -> str:
        """What the transfers run over (``config.protocol``: ``"tcp"`` or ``"rdma"``)."""
        return self.config.protocol

    @property
    def raw_client(self):
        """The Mooncake client the store's calls run on now, for baselines that call
        Mooncake directly on the same connection (its calls bypass every bound)."""
        return self._state.client

    @property
    def closed(self) -> bool:
        return self._clients.closed

    def close(self) -> None:
        """Wait for calls in flight, unregister every region, close the client and stop the
        embedded master. Idempotent. With a remote master that is gone, Mooncake's client
        takes 10-20 s to close."""
        if self._clients.close():
            self._finalizer()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "embedded" if self.master is not None else "remote"
        state = "closed" if self.closed else "open"
        return f"MooncakeStore({self.address}, {kind}, {self.config.protocol}, {state})"

    def _replace_client(self, old) -> None:
        """Replace ``old`` (whose data call timed out) by a new client (:class:`Clients`)."""
        self._clients.replace(old)

    # -- memory registration ---------------------------------------------------------------
    def register(self, staging) -> None:
        """Register the memory of ``staging`` (a :class:`kvmove.StagingBuffer`, or its
        ``(address, nbytes)`` regions) with the transfer engine, once per region (needed for
        RDMA, cheap for TCP; put/get register what was not). A registration never outlives
        its memory (:mod:`kvmove.store.registration`)."""
        with self._clients.slot(), self._state.register_lock:
            self._regions.register(staging)

    def unregister(self, staging) -> None:
        """Unregister the regions of ``staging``. Raises :class:`kvmove.StoreError`, and
        unregisters nothing, while a put or get is using one of them (wait for the
        transfers first: ``KVMover.close()`` does)."""
        with self._clients.slot(), self._state.register_lock:
            self._regions.unregister(staging)

    # -- calls -----------------------------------------------------------------------------
    def _batch(self, fn: Callable, keys: list[str], *args, here: bool = False,
               spans: int | None = None) -> list[int]:
        """One Mooncake batch call, bounded (:meth:`Clients.bounded`): its per-key codes
        (:func:`~kvmove.store.results.batch_codes`). ``spans``: a data call's spans, where
        the caller knows them (counted otherwise)."""
        data = getattr(fn, "__name__", "") in DATA_CALLS
        if data and spans is None:
            spans = sum(map(len, args[0]))
        outcome = self._bounded(fn, keys, *args, spans=spans if data else 0, here=here)
        return batch_codes(fn, keys, outcome, data)

    def _span_chunks(self, desc: Descriptors) -> list[slice]:
        return span_chunks(desc, self.config.max_batch_keys, self.limits)

    def put(self, desc: Descriptors, *, detect_exists: bool | None = None,
            until_returned: bool = False) -> StoreResult:
        """Store each key's spans as one object: ``OK``, ``EXISTS``, ``NO_SPACE`` or
        ``FAILED`` per key. ``detect_exists`` (default ``config.detect_exists``): ask the
        master first which keys exist, report them ``EXISTS`` and do not send them.
        ``until_returned=True``: the put's data calls run on this thread and it returns
        once Mooncake has (``.late`` is then ``None``)."""
        desc = check_desc(desc)
        if not isinstance(until_returned, bool):
            raise TypeError(f"until_returned must be a bool, got {until_returned!r}")
        check = self.config.detect_exists if detect_exists is None else bool(detect_exists)
        with self._clients.slot() as client:
            return self._put(client, desc, check, None, until_returned)

    def begin_put(self, keys: Sequence[str], *, detect_exists: bool | None = None
                  ) -> PendingPut:
        """Start a put of ``keys`` whose descriptors are not made yet: the exists check (for
        up to ``config.max_batch_keys`` keys) runs now, in the background; ``put(desc)`` of
        the :class:`PendingPut` sends the others. Use it as a context manager: it holds a
        client until it ends. Raises :class:`StoreError` when the store is closed."""
        keys = check_keys(keys, unique=False)
        check = self.config.detect_exists if detect_exists is None else bool(detect_exists)
        clients = self._clients
        client = clients.take()
        try:
            early = check and 0 < len(keys) <= self.config.max_batch_keys
            query = start_call(client.batch_is_exist, keys) if early else None
        except BaseException:
            clients.drop(client)
            raise
        return PendingPut(keys, client.batch_is_exist, query,
                          put=lambda desc, flags: self._put(client, desc, check, flags),
                          outcome=clients.outcome, release=lambda: clients.drop(client))

    def _put(self, client, desc: Descriptors, check: bool, flags: list[int] | None,
             here: bool = False) -> StoreResult:
        """A put on ``client``; ``flags``: the exists check's codes for ``desc``'s keys, when
        asked already (a check that stops the call ends every key with its code, nothing
        sent); ``here``: the calls run on this thread."""
        with self._regions.using(desc) as uses:
            if flags is not None and stops_the_call(flags):
                codes = Codes(flags)
            else:
                codes = run_chunks(
                    span_chunks(desc, self.config.max_batch_keys, self.limits),
                    lambda c: self._put_chunk(client, desc[c], check,
                                              None if flags is None else flags[c], here),
                    self.limits, self.address)
            uses.late = codes.late
        result = StoreResult(put_statuses(codes), codes, uses.late,
                             stored_late(codes.late_puts, uses.late))
        log_outcome("put", desc.keys, result)
        return result

    def _put_chunk(self, client, part: Descriptors, detect_exists: bool,
                   flags: list[int] | None = None, here: bool = False) -> list[int]:
        first = None  # the first put's codes, when the check's own call made it
        if detect_exists:
            if flags is None and here:
                # The check names no memory: handed to the runner, timed out at the bound
                # (no put then), never waited for past it; the put runs here.
                flags = self._batch(client.batch_is_exist, part.keys)
            elif flags is None:
                flags, first = self._check_then_put(client, part)
            if stops_the_call(flags):
                return flags
        codes: list[int | None] | None = None  # None: no key answered yet, all to put
        todo: list[int] | None = None  # the keys to put; None: every key
        if detect_exists and 1 in flags:
            codes = [OBJECT_ALREADY_EXISTS if flag == 1 else None for flag in flags]
            todo = [i for i, c in enumerate(codes) if c is None]
        late, late_puts = [], []
        for attempt in range(2):
            if todo is not None and not todo:
                break
            sub = part if todo is None else part.select(todo)
            result = first if first is not None else self._batch(
                client.batch_put_from_multi_buffers, sub.keys, sub.ptrs, sub.sizes,
                self._replicate, here=here, spans=sub.num_spans)
            first = None
            late.append(getattr(result, "late", None))
            if late[-1] is not None:
                late_puts.append((list(sub.keys), late[-1]))
            if todo is None:
                codes = list(result)
            else:
                for i, code in zip(todo, result, strict=True):
                    codes[i] = code
            # Once more for a lease that expired mid-transfer, and for a transfer that failed
            # (a replica placed on a holder that died: the master may pick a live one now;
            # a failed put leaves no object behind).
            if attempt or (LEASE_EXPIRED not in result and TRANSFER_FAIL not in result):
                break
            todo = [i for i, c in enumerate(codes) if c in (LEASE_EXPIRED, TRANSFER_FAIL)]
        return Codes(codes, settled(late), late_puts)

    def _check_then_put(self, client, part: Descriptors
                        ) -> tuple[list[int], list[int] | None]:
        """:func:`~kvmove.store.pending_put.check_then_put` on ``client``."""
        return check_then_put(client, part, budget=self._clients.budgets.get(id(client)),
                              replicate=self._replicate, timeout=self.config.call_timeout,
                              timed_out=self._clients.timed_out)

    def get(self, desc: Descriptors, *, until_returned: bool = False) -> StoreResult:
        """Read each key's object into its spans: ``OK`` only when the object is exactly the
        described size; ``MISS``, ``SIZE_MISMATCH`` or ``FAILED`` otherwise. A key whose
        holder is dead is read from another live replica in the same call, where it has
        one. ``until_returned=True``: the reads run on this thread and it returns once
        Mooncake has (``.late`` is then ``None``)."""
        desc = check_desc(desc)
        if not isinstance(until_returned, bool):
            raise TypeError(f"until_returned must be a bool, got {until_returned!r}")
        expected = desc.object_sizes()
        # The client slot and the regions' use spelled out: the hot path of a load (each
        # context manager's frames cost a few µs on a cold cache)
        clients, regions = self._clients, self._regions
        client = clients.take()
        try:
            used = regions.use(desc)
            late = None
            try:
                chunks = span_chunks(desc, self.config.max_batch_keys, self.limits)
                if len(chunks) == 1:  # the usual case: one call on this thread
                    codes = self._get_chunk(client, desc, until_returned)
                else:
                    codes = run_chunks(chunks, lambda c: self._get_chunk(
                        client, desc[c], until_returned), self.limits, self.address)
                if codes == expected:  # the common case: every key read in full, in time
                    result = StoreResult([Status.OK] * len(codes), codes)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("get of %d keys: %s", len(codes), result.summary())
                    return result
                timed_out = [getattr(codes, "late", None)]
                if TRANSFER_FAIL in codes:
                    timed_out.append(self._failover(client, desc, codes))
                late = settled(timed_out)
                statuses = self._get_statuses(client, desc.keys, codes, expected)
            finally:
                late = regions.release(used, late)
        finally:
            clients.drop(client)
        if until_returned and late is not None:  # a failover's read that timed out
            wait_until_returned(late)  # once the read has, and its regions are released
            late = None
        result = StoreResult(statuses, codes, late)
        log_outcome("get", desc.keys, result)
        return result

    def _get_chunk(self, client, part: Descriptors, here: bool = False) -> list[int]:
        fn = client.batch_get_into_multi_buffers  # a data call (no _batch: the hot path)
        codes = batch_codes(fn, part.keys, self._bounded(fn, part.keys, part.ptrs, part.sizes,
                                                         spans=part.num_spans, here=here), True)
        retry = ([i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
                 if LEASE_EXPIRED in codes else None)  # the scan in C first: mostly none
        if retry:
            sub = part.select(retry)
            again = self._batch(client.batch_get_into_multi_buffers, sub.keys, sub.ptrs,
                                sub.sizes, here=here, spans=sub.num_spans)
            for i, code in zip(retry, again, strict=True):
                codes[i] = code
            if getattr(again, "late", None) is not None:
                return Codes(codes, settled([getattr(codes, "late", None), again.late]))
        return codes

    def _get_statuses(self, client, keys: list[str], codes: list[int],
                      expected: list[int]) -> list[Status]:
        """Each key's status from its get code. A ``-600``/``-800`` is told apart by asking
        the master ``get_size(key)`` (bounded), one key after the other; once one question
        times out or the master is unreachable, the keys left are not asked."""
        statuses, ask = [], True
        for key, code, size in zip(keys, codes, expected, strict=True):
            stored = CLIENT_EXCEPTION  # the object's stored size, when asked and answered
            if ask and code in (INVALID_PARAMS, TRANSFER_FAIL):
                asked = self._bounded(client.get_size, key)
                if asked.done and asked.error is None:
                    stored = asked.value
                ask = asked.done and stored not in UNREACHABLE
            statuses.append(get_status(code, size, stored))
        return statuses

    def _failover(self, client, desc: Descriptors, codes: list[int]):
        """:meth:`Failover.run` for the keys of a get whose transfer failed."""
        return self._failovers.run(client, desc, codes, self._bounded)

    # -- queries ---------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> StoreResult:
        """Whether each key is stored (``True``/``False``; a key the master could not
        answer for is ``False``, its code in ``.codes`` is negative)."""
        keys = check_keys(keys, unique=False)
        with self._clients.slot() as client:
            codes = run_chunks(key_chunks(len(keys), self.config.max_batch_keys),
                               lambda c: self._batch(client.batch_is_exist, keys[c]),
                               self.limits, self.address)
        errors = [c for c in codes if c < 0]
        if errors:
            log.warning("exists: %d of %d keys unanswered (%s)", len(errors), len(keys),
                        code_name(errors[0]))
        return StoreResult([c == 1 for c in codes], codes)

    def replicas(self, keys: Sequence[str]) -> list[list[Replica]]:
        """Where each key's memory replicas live, in the master's order (a get reads the
        first): a list of :class:`~kvmove.store.replica_reader.Replica` per key; ``[]`` for
        a key not stored, and for every key when the master did not answer (logged)."""
        keys = check_keys(keys, unique=False)
        if not keys:
            return []
        with self._clients.slot() as client:
            out = self._bounded(client.batch_get_replica_desc, keys)
        if not out.done or out.error is not None:
            log.warning("replicas: the master did not list the replicas of %d keys (%s)",
                        len(keys), out.error or "no answer")
            return [[] for _ in keys]
        return [replicas_of(out.value.get(k)) for k in keys]

    def remove(self, keys: Sequence[str], *, force: bool = False) -> StoreResult:
        """Remove keys: ``OK``, ``MISS`` (no such key) or ``FAILED`` per key; a key read
        within the master's lease time (``-706``) is kept unless ``force``."""
        keys = check_keys(keys, unique=False)
        with self._clients.slot() as client:
            codes = run_chunks(key_chunks(len(keys), self.config.max_batch_keys),
                               lambda c: self._batch(client.batch_remove, keys[c], bool(force)),
                               self.limits, self.address)
        result = StoreResult(remove_statuses(codes), codes)
        log_outcome("remove", keys, result)
        return result
