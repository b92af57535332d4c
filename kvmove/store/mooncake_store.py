"""``MooncakeStore``: zero-copy put/get of staging pages through a Mooncake store.

Every call returns one :class:`kvmove.Status` per key, in key order, as a
:class:`StoreResult` (a ``list``) whose ``codes`` attribute keeps Mooncake's raw result of
each key for logs. A store failure is a per-key status, never an exception that loses the
other keys' results: a Mooncake call that raises marks the keys of that call ``FAILED`` (code
``-1``). Two things do raise :class:`kvmove.StoreError`: a master that cannot be reached when
the store is opened (probed with a plain TCP connect, bounded by ``connect_timeout``, before
Mooncake's ``setup()``, which would retry for ~90 s), and a Mooncake answer with the wrong
number of results (a broken contract, never silently truncated).

Statuses (API.md "The store"):

- ``put``: ``0`` -> ``OK``; key already stored -> ``EXISTS`` (the stored object is kept);
  ``-200`` -> ``NO_SPACE``; anything else -> ``FAILED``. Mooncake 0.3.13 answers ``0`` for a
  put of an existing key (and skips the transfer), so with ``config.detect_exists`` (the
  default) the store first asks ``batch_is_exist`` for the batch: keys that exist are
  reported ``EXISTS`` with code ``-705`` and are not put again. Two writers racing on one
  new key may both see ``OK``; the first object is kept.
- ``get``: a result equal to the described size -> ``OK`` (nothing else counts as a hit);
  ``-704`` -> ``MISS``; ``-703`` (REPLICA_IS_NOT_READY: a put of the key has started and not
  finished, so there is no object to read yet) -> ``MISS``; another non-negative size ->
  ``SIZE_MISMATCH``; ``-600`` (the destination is smaller than the object) and ``-800``
  (TRANSFER_FAIL, which 0.3.13 also answers when the destination is *larger*) are told apart
  from a real failure by asking ``get_size(key)``: a stored size other than the described
  one -> ``SIZE_MISMATCH``; the key gone -> ``MISS``; otherwise ``FAILED``.
- ``remove``: ``0`` -> ``OK``; ``-704`` -> ``MISS``; anything else (``-706``: the key was
  read within the lease time and ``force`` was not given) -> ``FAILED``.
- ``-707`` (lease expired during the transfer) is retried once for put and get.

Mooncake behaviours this relies on (0.3.13, verified against a real master by the tests):

- any read of a key, ``exists()`` and the put's EXISTS check included, leases it to readers
  for the master's ``--default_kv_lease_ttl`` (10 s by default); ``remove`` of a leased key
  answers ``-706`` unless ``force``;
- once the master is gone, the first call on a connection answers ``-900`` at once and later
  ones after ~4 s (a reconnect attempt). A batch whose chunk fails entirely with an RPC
  error therefore stops: its remaining keys get the same code untried;
- ``close()`` of a client whose master is gone blocks ~10-20 s with the GIL held (see
  :func:`_shutdown`).

Large batches are split into calls of at most ``config.max_batch_keys`` keys.

Threads: Mooncake's client is thread-safe and releases the GIL. The store's own lock guards
only its bookkeeping (registered regions, the open/closed state, the count of calls in
flight) and is never held across a Mooncake data call, so puts and gets from several threads
run concurrently. ``register``/``unregister`` are serialised among themselves. Each put and
get counts itself as a user of the registered regions its spans live in while it runs, and
``unregister`` of a region in use raises ``StoreError`` (nothing is unregistered) instead of
pulling memory from under a transfer. ``close()`` waits for the calls in flight, then rejects
new ones with ``StoreError``.

A master that restarts (on the same address) needs nothing from the caller: Mooncake's
client reconnects by itself. Calls while it is down end ``FAILED`` per key; within about a
second of its return the client has mounted its segment again (calls in that second may
still answer ``FAILED``, puts ``NO_SPACE``); objects stored before the restart are gone and
read back as ``MISS``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from kvmove.descriptors import Descriptors, check_keys
from kvmove.errors import StoreError
from kvmove.status import (
    CLIENT_EXCEPTION,
    INVALID_PARAMS,
    LEASE_EXPIRED,
    NO_SPACE_CODES,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    REPLICA_IS_NOT_READY,
    RPC_FAIL,
    RPC_TIMEOUT,
    TRANSFER_FAIL,
    Status,
    code_name,
)
from kvmove.store.config import StoreConfig
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S, EmbeddedMaster, tcp_reachable
from kvmove.store.native_log import native_stderr_captured, quiet_mooncake_log

log = logging.getLogger(__name__)

__all__ = ["EMBEDDED_DEFAULTS", "MooncakeStore", "StoreResult"]


# What embedded() sets unless overridden: a TCP client of the private master.
EMBEDDED_DEFAULTS = {
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "rdma_devices": "",
    "local_hostname": "127.0.0.1",
    "global_segment_size": 1 << 30,
    "local_buffer_size": 16 << 20,
}


class StoreResult(list):
    """One entry per key, in key order (``Status``, or ``bool`` for ``exists``), with
    ``codes``: Mooncake's raw result of each key (a byte count for a successful get, ``0``
    for other successes, a negative Mooncake error code otherwise; ``-705`` for a put
    skipped because the key exists, ``-1`` when the Mooncake call raised)."""

    __slots__ = ("codes",)

    def __init__(self, values: Iterable = (), codes: Iterable[int] = ()):
        super().__init__(values)
        self.codes = list(codes)

    @property
    def all_ok(self) -> bool:
        """Whether every key is ``Status.OK``."""
        return all(s is Status.OK for s in self)

    def summary(self) -> dict[str, int]:
        """How many keys ended with each status, e.g. ``{"ok": 4094, "miss": 2}``."""
        return {getattr(k, "value", str(k)): v for k, v in Counter(self).items()}


def _put_status(code: int) -> Status:
    if code == 0:
        return Status.OK
    if code == OBJECT_ALREADY_EXISTS:
        return Status.EXISTS
    if code in NO_SPACE_CODES:
        return Status.NO_SPACE
    return Status.FAILED


def _remove_status(code: int) -> Status:
    if code == 0:
        return Status.OK
    if code == OBJECT_NOT_FOUND:
        return Status.MISS
    return Status.FAILED


def _unreachable(codes: list[int]) -> bool:
    """Whether every code of a call says the master could not be reached."""
    return bool(codes) and all(c in (RPC_FAIL, RPC_TIMEOUT) for c in codes)


class _ClientState:
    """What closing needs, held apart from the store so a finalizer can close it."""

    def __init__(self, client, master: EmbeddedMaster | None):
        self.client = client
        self.master = master
        self.registered: dict[int, int] = {}  # address -> nbytes
        self.in_use: Counter = Counter()  # address -> put/get calls using the region now
        self.stale: deque = deque()  # regions of garbage-collected staging buffers


def _shutdown(state: _ClientState) -> None:
    """Unregister every region, close the client, stop the embedded master. Runs once,
    from close() or a finalizer (garbage collection, interpreter exit).

    Against a master that is gone, Mooncake's ``close()`` blocks for 10-20 s holding the
    GIL (it retries to unmount the segment). An embedded master that died is therefore
    restarted on its port for the client to say goodbye to; a remote one cannot be."""
    client, state.client = state.client, None
    if client is None:
        return
    for address in list(state.registered):
        with contextlib.suppress(Exception):
            client.unregister_buffer(address)
    state.registered.clear()
    if state.master is not None and not state.master.running:
        try:
            state.master.restart()
        except StoreError as e:
            log.warning("could not restart the embedded master for a quick close: %s", e)
    try:
        client.close()
    except Exception:
        log.exception("Mooncake client close() raised")
    if state.master is not None:
        state.master.stop()


class MooncakeStore:
    """A Mooncake store client for kvmove descriptors.

    ``MooncakeStore(config)`` joins an existing store (``config``: a
    :class:`~kvmove.StoreConfig` or a dict with its fields); :meth:`from_env` reads SGLang's
    ``MOONCAKE_*`` variables; :meth:`embedded` starts a private master on loopback first.
    Use as a context manager, or call :meth:`close`. See the module docstring for statuses,
    codes and threads.
    """

    def __init__(self, config: StoreConfig | Mapping, *, _master: EmbeddedMaster | None = None):
        self.config = StoreConfig.coerce(config)
        self._lock = threading.Condition()
        self._register_lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        client = self._connect(self.config, _master)
        self._state = _ClientState(client, _master)
        self._client = client
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        from mooncake.store import ReplicateConfig

        self._replicate = ReplicateConfig()
        self._replicate.replica_num = self.config.replicas

    # -- opening ---------------------------------------------------------------------------
    @staticmethod
    def _connect(config: StoreConfig, master: EmbeddedMaster | None):
        address = config.master_address
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if not tcp_reachable(host, int(port), config.connect_timeout):
            detail = ""
            if master is not None:
                detail = f"; embedded master log {master.log_path}:\n{master.log_tail()}"
            raise StoreError(
                f"cannot reach the Mooncake master at {address}: no TCP connection within "
                f"{config.connect_timeout:g}s (is mooncake_master running there?){detail}"
            )
        quiet_mooncake_log()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreError(
                "the Mooncake Python package is not installed (pip install "
                "mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda on a machine "
                f"without CUDA): {e}"
            ) from e
        said: list[str] = []
        try:
            with native_stderr_captured() as said:  # glog's set-up lines go to the logger
                client = MooncakeDistributedStore()
                rc = client.setup(
                    config.local_hostname,
                    config.metadata_server,
                    config.global_segment_size,
                    config.local_buffer_size,
                    config.protocol,
                    config.rdma_devices,
                    address,
                )
        except Exception as e:  # a pybind argument or engine error
            raise StoreError(f"Mooncake setup() against the master at {address} raised: {e}") \
                from e
        if rc != 0:
            raise StoreError(
                f"Mooncake setup() against the master at {address} failed with code {rc} "
                f"({code_name(rc)}); protocol={config.protocol!r}, "
                f"metadata_server={config.metadata_server!r}, "
                f"global_segment_size={config.global_segment_size} (Mooncake needs at least "
                f"16 MiB, or 0), local_hostname={config.local_hostname!r}"
                + (f"; Mooncake said: {' | '.join(said[-3:])}" if said else "")
            )
        log.info("joined Mooncake store at %s (%s, %s)", address, config.protocol,
                 config.metadata_server)
        return client

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> MooncakeStore:
        """A store configured by SGLang's ``MOONCAKE_*`` environment variables
        (:meth:`kvmove.StoreConfig.from_env`)."""
        return cls(StoreConfig.from_env(environ, **overrides))

    @classmethod
    def embedded(
        cls,
        *,
        kv_lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = DEFAULT_CLIENT_TTL_S,
        master_args: Sequence[str] = (),
        **overrides,
    ) -> MooncakeStore:
        """Start a private ``mooncake_master`` on free loopback ports and join it over TCP
        (``P2PHANDSHAKE``); ``close()`` stops the master. ``overrides`` set
        :class:`~kvmove.StoreConfig` fields (default segment 1 GiB, see
        ``EMBEDDED_DEFAULTS``), ``replicas=2`` among them; ``kv_lease_ttl_ms``,
        ``client_ttl_s`` (how long the master keeps a client that stopped answering,
        :class:`kvmove.EmbeddedMaster`) and ``master_args`` go to the master. Other
        processes join the same master with ``MooncakeStore(StoreConfig(master_address=
        store.address))``."""
        if "master_address" in overrides:
            raise ValueError("embedded() starts its own master; do not pass master_address")
        values = {**EMBEDDED_DEFAULTS, **overrides}
        StoreConfig.from_dict({**values, "master_address": "127.0.0.1:1"})  # validate first
        master = EmbeddedMaster(kv_lease_ttl_ms=kv_lease_ttl_ms, client_ttl_s=client_ttl_s,
                                extra_args=master_args)
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
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def _call_slot(self):
        with self._lock:
            if self._closed:
                raise StoreError(f"the store at {self.address} is closed")
            self._in_flight += 1
        try:
            yield self._client
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._lock.notify_all()

    def close(self) -> None:
        """Wait for calls in flight, unregister every region, close the client and stop the
        embedded master. Idempotent. With a remote master that is gone, Mooncake's client
        takes 10-20 s to close (see :func:`_shutdown`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._lock.wait()
        self._finalizer()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "embedded" if self.master is not None else "remote"
        state = "closed" if self._closed else "open"
        return f"MooncakeStore({self.address}, {kind}, {self.config.protocol}, {state})"

    # -- memory registration ---------------------------------------------------------------
    @staticmethod
    def _regions_of(staging) -> list[tuple[int, int]]:
        regions = staging.regions() if hasattr(staging, "regions") else staging
        try:
            return [(int(a), int(n)) for a, n in regions]
        except (TypeError, ValueError):
            raise TypeError(
                "expected a StagingBuffer (or its (address, nbytes) regions), got "
                f"{type(staging).__name__}"
            ) from None

    def register(self, staging) -> None:
        """Register the memory of ``staging`` (a :class:`kvmove.StagingBuffer`, or its
        ``(address, nbytes)`` regions) with the transfer engine. Idempotent: each region is
        registered once. Needed for RDMA; cheap for TCP. ``put``/``get`` register a
        descriptor's staging themselves when this was not done.

        Registrations never outlive the memory: a staging buffer's regions are unregistered
        once it is garbage-collected, and a registered region that overlaps a new one (so
        its memory was freed and reused) is unregistered before the new one is registered.
        """
        with self._call_slot() as client, self._register_lock:
            self._register(client, staging)

    def _register(self, client, staging) -> None:
        """Register the regions of ``staging`` that are not registered yet. The caller holds
        ``_register_lock``."""
        regions = self._regions_of(staging)
        state = self._state
        self._drop_stale(client)
        added = False
        for address, nbytes in regions:
            if state.registered.get(address) == nbytes:
                continue
            for old, size in list(state.registered.items()):
                if old < address + nbytes and address < old + size:  # freed memory
                    if state.in_use[old]:
                        raise StoreError(
                            f"cannot register {address:#x} + {nbytes}: it overlaps the "
                            f"registered region {old:#x} + {size}, which "
                            f"{state.in_use[old]} put/get call(s) are using"
                        )
                    client.unregister_buffer(old)
                    del state.registered[old]
                    log.debug("unregistered stale region %#x + %d", old, size)
            rc = client.register_buffer(address, nbytes)
            if rc != 0:
                raise StoreError(
                    f"register_buffer({address:#x}, {nbytes}) failed with code {rc} "
                    f"({code_name(rc)})"
                )
            state.registered[address] = nbytes
            added = True
            log.debug("registered %#x + %d", address, nbytes)
        if added and hasattr(staging, "regions"):
            # Forget the regions when the staging dies: the finalizer only queues them
            # (it may run inside any allocation, even with the lock held here).
            with contextlib.suppress(TypeError):
                weakref.finalize(staging, state.stale.append, tuple(regions))

    def _drop_stale(self, client) -> None:
        """Unregister regions of staging buffers that were garbage-collected."""
        state = self._state
        while state.stale:
            for address, nbytes in state.stale.popleft():
                if state.registered.get(address) == nbytes:
                    del state.registered[address]
                    client.unregister_buffer(address)

    def unregister(self, staging) -> None:
        """Unregister the regions of ``staging``. Raises :class:`kvmove.StoreError`, and
        unregisters nothing, while a put or get is using one of them (wait for the
        transfers first: ``KVMover.close()`` does)."""
        regions = self._regions_of(staging)
        with self._call_slot() as client, self._register_lock:
            in_use = self._state.in_use
            busy = [(a, in_use[a]) for a, _ in regions if in_use[a]]
            if busy:
                address, calls = busy[0]
                raise StoreError(
                    f"cannot unregister the staging region {address:#x}: {calls} put/get "
                    f"call(s) in flight are using it (wait for the transfers to end first)"
                )
            for address, _ in regions:
                if self._state.registered.pop(address, None) is not None:
                    rc = client.unregister_buffer(address)
                    if rc != 0:
                        log.warning("unregister_buffer(%#x) returned %d", address, rc)

    @contextlib.contextmanager
    def _using(self, client, desc: Descriptors):
        """Register the memory of ``desc`` if needed, and count this call as a user of its
        registered regions until the block ends (``unregister`` refuses them meanwhile)."""
        state = self._state
        with self._register_lock:
            registered = state.registered
            if state.stale or any(registered.get(a) != n for a, n in desc.regions):
                self._register(client, desc.staging if desc.staging is not None
                               else desc.regions)
            used = [a for a, _ in desc.regions] or self._regions_touched(desc)
            for address in used:
                state.in_use[address] += 1
        try:
            yield
        finally:
            with self._register_lock:
                for address in used:
                    state.in_use[address] -= 1
                    if not state.in_use[address]:
                        del state.in_use[address]

    def _regions_touched(self, desc: Descriptors) -> list[int]:
        """The registered regions that spans of ``desc`` start in (for descriptors built
        from lists, which name no regions). The caller holds ``_register_lock``."""
        if not desc.ptrs or not self._state.registered:
            return []
        starts = np.fromiter((p for row in desc.ptrs for p in row), dtype=np.uint64)
        return [a for a, n in self._state.registered.items()
                if bool(((starts >= a) & (starts < a + n)).any())]

    # -- calls -----------------------------------------------------------------------------
    def _batch(self, fn: Callable, keys: list[str], *args) -> list[int]:
        """One Mooncake batch call: its per-key results, ``CLIENT_EXCEPTION`` for every key
        when it raises, ``StoreError`` when it answers for a different number of keys."""
        try:
            result = fn(keys, *args)
        except Exception:
            log.exception("Mooncake %s of %d keys raised; marking them failed",
                          fn.__name__, len(keys))
            return [CLIENT_EXCEPTION] * len(keys)
        if len(result) != len(keys):
            raise StoreError(
                f"Mooncake {fn.__name__} answered {len(result)} results for {len(keys)} keys "
                f"(first key {keys[0]!r}); refusing to guess which keys they belong to"
            )
        return list(result)

    def _chunked(self, n: int, run: Callable[[slice], list[int]]) -> list[int]:
        """The per-key codes of ``run(chunk)`` over chunks of at most ``max_batch_keys``
        keys. When every key of a chunk fails with an RPC error the master is unreachable,
        and each further call would wait ~4 s for Mooncake to reconnect: the remaining keys
        get the same code untried."""
        step = self.config.max_batch_keys
        codes: list[int] = []
        for start in range(0, n, step):
            part = run(slice(start, min(start + step, n)))
            codes += part
            if len(codes) < n and _unreachable(part):
                log.warning("master %s unreachable (%s); %d keys not tried", self.address,
                            code_name(part[0]), n - len(codes))
                codes += [part[0]] * (n - len(codes))
                break
        return codes

    @staticmethod
    def _check_desc(desc) -> Descriptors:
        if not isinstance(desc, Descriptors):
            raise TypeError(f"expected kvmove.Descriptors (from describe()), got {type(desc)}")
        return desc

    def put(self, desc: Descriptors, *, detect_exists: bool | None = None) -> StoreResult:
        """Store each key's spans as one object. One :class:`Status` per key (``OK``,
        ``EXISTS``, ``NO_SPACE`` or ``FAILED``); ``.codes`` holds Mooncake's codes.

        ``detect_exists`` (default ``config.detect_exists``): ask the master first which
        keys exist, to report them ``EXISTS`` and not send them. Without it a stored key
        is reported ``OK`` (Mooncake keeps the stored object either way)."""
        desc = self._check_desc(desc)
        check = self.config.detect_exists if detect_exists is None else bool(detect_exists)
        with self._call_slot() as client, self._using(client, desc):
            codes = self._chunked(len(desc),
                                  lambda c: self._put_chunk(client, desc[c], check))
        result = StoreResult(map(_put_status, codes), codes)
        self._log_outcome("put", desc.keys, result)
        return result

    def _put_chunk(self, client, part: Descriptors, detect_exists: bool) -> list[int]:
        codes: list[int | None] = [None] * len(part)
        if detect_exists:
            flags = self._batch(client.batch_is_exist, part.keys)
            if _unreachable(flags):
                return flags
            for i in [i for i, flag in enumerate(flags) if flag == 1]:
                codes[i] = OBJECT_ALREADY_EXISTS
        todo = [i for i, c in enumerate(codes) if c is None]
        for attempt in range(2):
            if not todo:
                break
            sub = part if len(todo) == len(part) else part.select(todo)
            result = self._batch(client.batch_put_from_multi_buffers, sub.keys, sub.ptrs,
                                 sub.sizes, self._replicate)
            for i, code in zip(todo, result, strict=True):
                codes[i] = code
            todo = [i for i in todo if codes[i] == LEASE_EXPIRED] if attempt == 0 else []
        return codes  # type: ignore[return-value]

    def get(self, desc: Descriptors) -> StoreResult:
        """Read each key's object into its spans. One :class:`Status` per key: ``OK`` only
        when the object is exactly the described size; ``MISS``, ``SIZE_MISMATCH`` or
        ``FAILED`` otherwise. ``.codes`` holds Mooncake's results (byte counts or codes)."""
        desc = self._check_desc(desc)
        expected = desc.object_sizes()
        with self._call_slot() as client, self._using(client, desc):
            codes = self._chunked(len(desc), lambda c: self._get_chunk(client, desc[c]))
            if codes == expected:  # the common case: every key read in full
                statuses = [Status.OK] * len(codes)
            else:
                statuses = [
                    self._get_status(client, key, code, size)
                    for key, code, size in zip(desc.keys, codes, expected, strict=True)
                ]
        result = StoreResult(statuses, codes)
        self._log_outcome("get", desc.keys, result)
        return result

    def _get_chunk(self, client, part: Descriptors) -> list[int]:
        codes = self._batch(client.batch_get_into_multi_buffers, part.keys, part.ptrs,
                            part.sizes)
        retry = [i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
        if retry:
            sub = part.select(retry)
            again = self._batch(client.batch_get_into_multi_buffers, sub.keys, sub.ptrs,
                                sub.sizes)
            for i, code in zip(retry, again, strict=True):
                codes[i] = code
        return codes

    @staticmethod
    def _get_status(client, key: str, code: int, size: int) -> Status:
        if code == size:
            return Status.OK
        if code >= 0:
            return Status.SIZE_MISMATCH
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return Status.MISS
        if code in (INVALID_PARAMS, TRANSFER_FAIL):
            try:
                stored = client.get_size(key)
            except Exception:
                stored = CLIENT_EXCEPTION
            if stored == OBJECT_NOT_FOUND:
                return Status.MISS
            if stored >= 0:
                return Status.FAILED if stored == size else Status.SIZE_MISMATCH
            return Status.SIZE_MISMATCH if code == INVALID_PARAMS else Status.FAILED
        return Status.FAILED

    def exists(self, keys: Sequence[str]) -> StoreResult:
        """Whether each key is stored (``True``/``False``; a key the master could not
        answer for is ``False``, its code in ``.codes`` is negative)."""
        keys = check_keys(keys, unique=False)
        with self._call_slot() as client:
            codes = self._chunked(len(keys), lambda c: self._batch(client.batch_is_exist,
                                                                    keys[c]))
        errors = [c for c in codes if c < 0]
        if errors:
            log.warning("exists: %d of %d keys unanswered (%s)", len(errors), len(keys),
                        code_name(errors[0]))
        return StoreResult([c == 1 for c in codes], codes)

    def remove(self, keys: Sequence[str], *, force: bool = False) -> StoreResult:
        """Remove keys. ``OK``, ``MISS`` (no such key) or ``FAILED`` per key; a key read
        within the master's lease time (``-706``) is kept unless ``force``."""
        keys = check_keys(keys, unique=False)
        with self._call_slot() as client:
            codes = self._chunked(len(keys), lambda c: self._batch(client.batch_remove,
                                                                    keys[c], bool(force)))
        result = StoreResult(map(_remove_status, codes), codes)
        self._log_outcome("remove", keys, result)
        return result

    @staticmethod
    def _log_outcome(op: str, keys: list[str], result: StoreResult) -> None:
        failed = [i for i, s in enumerate(result) if s is Status.FAILED]
        if failed:
            names = Counter(code_name(result.codes[i]) for i in failed)
            log.warning("%s: %d of %d keys failed (%s); first %r", op, len(failed), len(keys),
                        ", ".join(f"{k} x{v}" for k, v in names.items()), keys[failed[0]])
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s of %d keys: %s", op, len(keys), result.summary())
