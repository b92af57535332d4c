"""``MooncakeStore``: zero-copy put/get of staging pages through a Mooncake store.

Every call returns one :class:`kvmove.Status` per key, in key order, as a
:class:`StoreResult` (a ``list``) whose ``codes`` attribute keeps Mooncake's raw result of
each key for logs. A store failure is a per-key status, never an exception that loses the
other keys' results: a Mooncake call that raises marks the keys of that call ``FAILED`` (code
``-1``). Two things do raise :class:`kvmove.StoreError`: a master that cannot be reached when
the store is opened (probed before Mooncake's ``setup()`` with an RPC request it must react
to within ``connect_timeout``: ``setup()`` would retry for ~90 s against a master that is not
there, and freeze this whole process, GIL held, against one that accepts connections but
does not answer, e.g. a stopped one), and a Mooncake answer with the wrong number of results
(a broken contract, never silently truncated).

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
  one -> ``SIZE_MISMATCH``; the key gone -> ``MISS``; otherwise ``FAILED``. Once one such
  question goes unanswered (given up, or the master unreachable), the keys left are not
  asked: ``-600`` -> ``SIZE_MISMATCH``, ``-800`` -> ``FAILED``.
- ``remove``: ``0`` -> ``OK``; ``-704`` -> ``MISS``; anything else (``-706``: the key was
  read within the lease time and ``force`` was not given) -> ``FAILED``.
- ``-707`` (lease expired during the transfer) is retried once for put and get, and a put's
  ``-800`` once (its replica went to a holder that died; a failed put leaves no object).

Mooncake behaviours this relies on (0.3.13, verified against a real master by the tests):

- any read of a key, ``exists()`` and the put's EXISTS check included, leases it to readers
  for the master's ``--default_kv_lease_ttl`` (10 s by default); ``remove`` of a leased key
  answers ``-706`` unless ``force``;
- once the master is gone, the first call on a connection answers ``-900`` at once and later
  ones after ~4 s (a reconnect attempt). A batch whose chunk fails entirely with an RPC
  error therefore stops: its remaining keys get the same code untried;
- ``close()`` of a client whose master is gone blocks ~10-20 s with the GIL held (see
  :func:`_shutdown`).

Batches are cut to what the transport carries: calls of at most ``config.max_batch_keys``
keys and at most the transport's spans and bytes per call, with at most its spans in flight
per client
(:mod:`kvmove.store.transport_limits`, the one place those limits live; over TCP the store
raises Mooncake's per-peer queues before set-up unless the user set them). The calls of one
put/get run one after the other (``limits.side_by_side``: side by side they were slower);
calls of different puts and gets share the spans in flight.

No call hangs (:mod:`kvmove.store.bounded_call`): every Mooncake call (a batch, or one master
RPC) is waited for at most ``config.call_timeout`` seconds once started, and a call waiting for
room in the transport's queue gives up when no call of its client returned for that long. A call
given up ends its keys ``FAILED`` (code ``CALL_TIMEOUT``, the cause in the log) and the calls of
that put/get/exists/remove not started yet are not tried (same code), so a put or get ends at
most about one ``call_timeout`` after the transport stopped making progress on it (a get's
``get_size`` questions, above, add at most one more, and so does its replica failover, below,
when the master stops answering). A put's exists check and its put of keys none of which exists
are one hand-off to the runner thread, each still bounded from its own start (a check given up
starts no put). Mooncake may still write into (get) or read from (put) the memory of a call
given up until it really returns (its own cap is 60 s): the result's ``late`` future completes
then, and until then the store keeps the regions in use (``unregister`` refuses them) and a
caller must not free or reuse that memory (:class:`kvmove.KVMover` holds the staging slots). A
caller that would wait for ``late`` anyway asks ``until_returned=True`` (``get``, ``put``): its
data calls run on its own thread, watched, given up at the same bound (the log, the
``CALL_TIMEOUT`` codes and the client's replacement come as above, from a watchdog thread), and
the put or get returns once they really returned. A client whose call was given up may be broken
towards that holder for good (a wedged TCP queue), so the store replaces it: a new client (no
segment of its own; the first client stays open while it holds this process's segment), the same
regions registered again. Calls already running on the old client (every chunk of a put or get
that started there) finish there, and it is closed only once none runs on it. A new client is
set up only against a master that answers (the probe above): while it does not, the old client
stays in use and the next call given up tries again.

Replica failover (:mod:`kvmove.store.replica_reader`): a key whose get failed in transport
(``-800``: its first-listed replica's holder is dead) and that has another complete replica
on a live holder is read from that replica, directly, within the same call: the keys are
leased (``batch_is_exist``), their replicas listed, dead holders found by a TCP probe of
their endpoint, the live replica read into the key's own spans by a Transfer Engine of the
store's own, and the key counts ``OK`` only when that replica is still listed at the same
address and size afterwards. Keys of a call given up are never read again (Mooncake may
still write into their spans).

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
import socket
import struct
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future

import numpy as np

from kvmove.errors import StoreError
from kvmove.objects.descriptors import Descriptors, check_keys
from kvmove.status import (
    CALL_TIMEOUT,
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
from kvmove.store.bounded_call import (
    CallOutcome,
    SpanBudget,
    StartedCall,
    call_bounded,
    call_watched,
    default_runner,
    settled,
    start_call,
    start_call_threads,
    wait_until_returned,
)
from kvmove.store.config import DEFAULT_TENANT_ID, StoreConfig
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S, EmbeddedMaster
from kvmove.store.native_log import native_stderr_captured, quiet_mooncake_log
from kvmove.store.replica_reader import EndpointProbe, Replica, ReplicaReader, replicas_of
from kvmove.store.transport_limits import limits_for, prepare_environment

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


class StoreResult(list):
    """One entry per key, in key order (``Status``, or ``bool`` for ``exists``), with
    ``codes``: Mooncake's raw result of each key (a byte count for a successful get, ``0``
    for other successes, a negative Mooncake error code otherwise; ``-705`` for a put
    skipped because the key exists, ``-1`` when the Mooncake call raised,
    ``kvmove.status.CALL_TIMEOUT`` for a call given up at ``call_timeout``), and ``late``:
    ``None``, or a future that completes when the Mooncake calls given up have really
    returned (until then they may still write into, or read from, the memory of the
    descriptors: do not free or reuse it). A put's ``late_stored``: ``None`` when no put
    call was given up, else a future that completes with ``late``'s calls and holds the keys
    those calls stored after all (answered ``0``, or raised: not known, counted as stored),
    whose bytes are whatever the spans held when Mooncake read them; a key a given-up call
    did not store (an error code; not tried) is not among them. Mooncake 0.3.13 answers
    ``0`` to a put of a key that exists too (keeping the stored object), so a key stored
    by another put after the exists check (``detect_exists``), or any existing key without
    that check, counts as stored."""

    __slots__ = ("codes", "late", "late_stored")

    def __init__(self, values: Iterable = (), codes: Iterable[int] = (), late=None,
                 late_stored: Future | None = None):
        super().__init__(values)
        self.codes = list(codes)
        self.late = late
        self.late_stored = late_stored

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


def _stops_the_call(codes: list[int]) -> bool:
    """Whether the rest of a put/get/exists/remove is not tried after this chunk: the
    master is unreachable, or a Mooncake call was given up at its bound."""
    return _unreachable(codes) or CALL_TIMEOUT in codes


# A request the master must react to: a coro_rpc request header (magic 0xde, version 1,
# struct_pack, request, sequence 0) for a function id no service registers, with no body.
_PROBE_REQUEST = struct.pack("<BBBBIIII", 0xDE, 1, 0, 0, 0, 0x6B766D76, 0, 0)
_NO_CONNECTION = "no TCP connection"
_NO_ANSWER = "no answer to an RPC request"


def _master_silence(host: str, port: int, timeout: float) -> str | None:
    """``None`` when the master at ``host:port`` reacts to an RPC request within ``timeout``
    seconds; otherwise why not, for an error message.

    A TCP connect alone is not enough: a stopped (SIGSTOP) or wedged master still accepts
    connections (the kernel does), and Mooncake's ``setup()`` against it waits for an
    answer with the GIL held, freezing every thread of this process. So the
    probe sends a request of an unknown function and waits for any reaction: the master
    (coro_rpc) answers it or closes the connection at once (measured: ~0.2 ms on loopback,
    nothing in its log); a master that does not run says nothing."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return _NO_CONNECTION
    with sock:
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_PROBE_REQUEST)
            sock.recv(1)  # an answer, or b"" when the master closed the connection
        except TimeoutError:
            return _NO_ANSWER
        except OSError:
            pass  # reset by the master: it reacted
    return None


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# The Mooncake calls that move bytes (their spans count against the transport's queue).
_DATA_CALLS = frozenset({"batch_put_from_multi_buffers", "batch_get_into_multi_buffers"})
# Seconds close() waits for calls given up to return (Mooncake's own cap is 60 s).
_LATE_CLOSE_WAIT_S = 75.0


class _PutGate:
    """Whether the put of a :func:`_check_then_put` may still start: not once its waiter
    gave up on the check (:meth:`close`), nor while the client's spans in flight leave no
    room for the put's ``spans`` (taken from ``budget`` when it starts, released by
    :meth:`put_returned`: a check takes none, however long it runs)."""

    __slots__ = ("_budget", "_closed", "_lock", "_spans", "_taken", "opened_at")

    def __init__(self, budget: SpanBudget | None, spans: int):
        self._lock = threading.Lock()
        self._closed = False
        self._budget, self._spans, self._taken = budget, spans, 0
        self.opened_at: float | None = None  # time.monotonic() when the put started

    def open(self) -> bool:
        """The runner's side: True (and the put may start now, its spans taken) unless
        closed or without room now."""
        with self._lock:
            if self._closed:
                return False
            if self._budget is not None:
                self._taken = self._budget.acquire(self._spans, 0.0)
                if not self._taken:
                    return False
            self.opened_at = time.monotonic()
            return True

    def put_returned(self) -> None:
        """The runner's side: the put has really returned; its spans are free."""
        if self._taken:
            self._budget.release(self._taken)

    def close(self) -> float | None:
        """The waiter's side: no put starts from now on; when the put had started."""
        with self._lock:
            self._closed = True
            return self.opened_at


def _check_then_put(client, gate: _PutGate, keys, ptrs, sizes, replicate):
    """Run on a runner thread: Mooncake's exists check of ``keys`` and then, when none of
    them exists and ``gate`` still opens (the put's spans taken), the put of every key.
    Returns ``(check codes, put codes or None, what the put raised or None)``; the check's
    own error is raised."""
    flags = client.batch_is_exist(keys)
    if len(flags) != len(keys) or any(flags) or not gate.open():
        return flags, None, None
    try:
        return flags, client.batch_put_from_multi_buffers(keys, ptrs, sizes, replicate), None
    except Exception as e:  # the put's, told apart from the check's
        return flags, None, e
    finally:
        gate.put_returned()


def _put_codes_when_done(call: Future) -> Future:
    """A future of the put codes of a :func:`_check_then_put` call (what its put raised,
    as its exception), completing when ``call`` does."""
    codes: Future = Future()

    def done(f: Future) -> None:
        try:
            _flags, value, error = f.result()
        except BaseException as e:
            codes.set_exception(e)
            return
        if error is not None:
            codes.set_exception(error)
        else:
            codes.set_result(value)

    call.add_done_callback(done)
    return codes


class _Codes(list):
    """A Mooncake call's per-key codes; ``late``: the call given up, when it was;
    ``late_puts``: ``(keys, future)`` of each put call given up (the future holds its raw
    codes once it returns)."""

    __slots__ = ("late", "late_puts")

    def __init__(self, values, late=None, late_puts=()):
        super().__init__(values)
        self.late = late
        self.late_puts = list(late_puts)


def _stored_late(late_puts: list[tuple[list[str], Future]], after: Future | None = None
                 ) -> Future | None:
    """A future holding the keys the put calls given up stored after all (their code ``0``;
    every key of a call that raised: not known), once every one of them has returned (and
    ``after``, the put's ``late``: its memory is released then)."""
    if not late_puts:
        return None
    stored: Future = Future()

    def collect(_f=None) -> None:
        keys = []
        for call_keys, future in late_puts:
            try:
                codes = list(future.result())
            except Exception:
                codes = [0] * len(call_keys)
            keys += [k for k, c in zip(call_keys, codes, strict=False) if c == 0]
        stored.set_result(keys)

    joined = settled([*(f for _, f in late_puts), after])
    if joined is None:
        collect()
    else:
        joined.add_done_callback(collect)
    return stored


class _Uses:
    """What a put/get tells ``_using`` at its end: the calls given up, if any."""

    __slots__ = ("late",)

    def __init__(self):
        self.late = None


class _Retired:
    """A client replaced after a call on it was given up: kept until its late calls have
    returned (and, while it holds this process's segment, until the store closes)."""

    def __init__(self, client, regions: list[int], holds_segment: bool):
        self.client = client
        self.regions = regions
        self.holds_segment = holds_segment


def _count_down(counter: Counter, key) -> int:
    """Decrement ``counter[key]``, dropping the entry at zero (ids are reused); what is left."""
    counter[key] -= 1
    left = counter[key]
    if left <= 0:
        del counter[key]
    return left


class _ClientState:
    """What closing needs, held apart from the store so a finalizer can close it."""

    def __init__(self, client, master: EmbeddedMaster | None):
        self.client = client
        self.master = master
        self.registered: dict[int, int] = {}  # address -> nbytes
        self.in_use: Counter = Counter()  # address -> put/get calls using the region now
        self.stale: deque = deque()  # regions of garbage-collected staging buffers
        self.retired: list[_Retired] = []  # replaced clients not closed yet
        self.retired_lock = threading.Lock()  # guards ``retired`` (and a retired client's close)
        # Who runs on which client (guarded by the store's ``_lock``): a retired client is
        # closed only once neither count has it.
        self.users: Counter = Counter()  # id(client) -> store calls (_call_slot) using it
        self.late: set = set()  # futures of Mooncake calls given up and still running
        self.late_on: Counter = Counter()  # id(client) -> its calls given up and running
        self.reader: ReplicaReader | None = None  # replica failover reads (made lazily)


def _wait_late(state: _ClientState, timeout: float) -> None:
    """Wait (bounded) for the Mooncake calls given up to return before closing clients."""
    late = [f for f in list(state.late) if not f.done()]
    if not late:
        return
    log.warning("closing the store: waiting up to %.0f s for %d Mooncake call(s) given up "
                "earlier to return", timeout, len(late))
    deadline = time.monotonic() + timeout
    for f in late:
        with contextlib.suppress(Exception):
            f.result(max(0.0, deadline - time.monotonic()))


def _shutdown(state: _ClientState) -> None:
    """Unregister every region, close the client, stop the embedded master. Runs once,
    from close() or a finalizer (garbage collection, interpreter exit).

    Against a master that is gone, Mooncake's ``close()`` blocks for 10-20 s holding the
    GIL (it retries to unmount the segment). An embedded master that died is therefore
    restarted on its port for the client to say goodbye to; a remote one cannot be."""
    client, state.client = state.client, None
    if client is None:
        return
    _wait_late(state, _LATE_CLOSE_WAIT_S)
    if state.reader is not None:
        with contextlib.suppress(Exception):
            state.reader.close()
    with state.retired_lock:
        retired, state.retired = state.retired, []
        closing = [r.client for r in retired if r.client is not None]
        for r in retired:
            r.client = None
    for address in list(state.registered):
        with contextlib.suppress(Exception):
            client.unregister_buffer(address)
    state.registered.clear()
    if state.master is not None and not state.master.running:
        try:
            state.master.restart()
        except StoreError as e:
            log.warning("could not restart the embedded master for a quick close: %s", e)
    for old in [*closing, client]:
        try:
            old.close()
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
        # Guards the client, the counts of calls in flight and the close (a C lock: taken
        # twice per call); close() waits on _calls_done for the calls in flight.
        self._lock = threading.RLock()
        self._calls_done = threading.Condition(self._lock)
        self._register_lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        client = self._connect(self.config, _master)
        self.limits = limits_for(self.config.protocol, call_spans=self.config.max_call_spans,
                                 inflight_spans=self.config.max_inflight_spans)
        self._budgets = {id(client): SpanBudget(self.limits.inflight_spans)}
        self._replace_lock = threading.Lock()
        self._segment_client = client if self.config.global_segment_size > 0 else None
        self._probe = EndpointProbe()
        self._reader_failed_at = -1e9
        self._state = _ClientState(client, _master)
        self._client = client
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        log.debug("store limits: %s", self.limits)
        from mooncake.store import ReplicateConfig

        self._replicate = ReplicateConfig()
        self._replicate.replica_num = self.config.replicas
        # The threads its calls run on start now, not in the first calls (~0.1 ms each): one
        # for a put and one for a get at a time (an engine's saving and loading threads),
        # or as many as a call runs side by side, and the watchdog.
        start_call_threads(max(2, self.limits.side_by_side))

    # -- opening ---------------------------------------------------------------------------
    @staticmethod
    def _connect(config: StoreConfig, master: EmbeddedMaster | None):
        prepare_environment(config.protocol)  # the TCP queues, read by setup()
        address = config.master_address
        silence = _master_silence(*_split_address(address), config.connect_timeout)
        if silence is not None:
            detail = ""
            if master is not None:
                detail = f"; embedded master log {master.log_path}:\n{master.log_tail()}"
            hint = ("is mooncake_master running there?" if silence == _NO_CONNECTION else
                    "it accepts connections: is the master stopped or hung?")
            raise StoreError(
                f"cannot reach the Mooncake master at {address}: {silence} within "
                f"{config.connect_timeout:g}s ({hint}){detail}"
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
                tenant = ({} if config.tenant_id == DEFAULT_TENANT_ID
                          else {"tenant_id": config.tenant_id})  # older Mooncake lacks it
                rc = client.setup(
                    config.local_hostname,
                    config.metadata_server,
                    config.global_segment_size,
                    config.local_buffer_size,
                    config.protocol,
                    config.rdma_devices,
                    address,
                    **tenant,
                )
        except TypeError as e:
            if tenant and "tenant_id" in str(e):
                raise StoreError(f"tenant_id={config.tenant_id!r}: the installed Mooncake "
                                 f"does not support tenants (upgrade it, or leave tenant_id "
                                 f"unset): {e}") from e
            raise StoreError(f"Mooncake setup() against the master at {address} raised: {e}") \
                from e
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
    def transport(self) -> str:
        """What the transfers run over (``config.protocol``: ``"tcp"`` or ``"rdma"``)."""
        return self.config.protocol

    @property
    def raw_client(self):
        """The Mooncake client the store's calls run on now, for baselines that call
        Mooncake directly on the same connection (its calls bypass every bound above)."""
        return self._client

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def _call_slot(self):
        """The current client, counted as a user of it until the block ends: a put/get of
        several chunks keeps using the client it started with even if it is replaced
        meanwhile, so a retired client is closed only once its last user is done."""
        client = self._take_client()
        try:
            yield client
        finally:
            self._drop_client(client)

    def _take_client(self):
        """The current client, counted as a user (and a call in flight, which ``close()``
        waits for) until :meth:`_drop_client`."""
        with self._lock:
            if self._closed:
                raise StoreError(f"the store at {self.address} is closed")
            self._in_flight += 1
            client = self._client
            self._state.users[id(client)] += 1
        return client

    def _drop_client(self, client) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0 and self._closed:  # close() waits for the last one
                self._calls_done.notify_all()
            last = not _count_down(self._state.users, id(client)) and client is not self._client
        if last:  # of a retired client
            self._finish_if_unused(client)

    def close(self) -> None:
        """Wait for calls in flight, unregister every region, close the client and stop the
        embedded master. Idempotent. With a remote master that is gone, Mooncake's client
        takes 10-20 s to close (see :func:`_shutdown`)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._calls_done.wait()
        with self._replace_lock:  # a replacement being set up finishes first
            pass
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
        client = state.client  # the current one (a replacement swaps under this lock)
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
                    if state.reader is not None:
                        state.reader.unregister(old)
                    log.debug("unregistered stale region %#x + %d", old, size)
            rc = client.register_buffer(address, nbytes)
            if rc != 0:
                raise StoreError(
                    f"register_buffer({address:#x}, {nbytes}) failed with code {rc} "
                    f"({code_name(rc)})"
                )
            state.registered[address] = nbytes
            if state.reader is not None:
                self._reader_register(address, nbytes)
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
                    if state.reader is not None:
                        state.reader.unregister(address)

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
            client = self._state.client
            for address, _ in regions:
                if self._state.registered.pop(address, None) is not None:
                    rc = client.unregister_buffer(address)
                    if rc != 0:
                        log.warning("unregister_buffer(%#x) returned %d", address, rc)
                    if self._state.reader is not None:
                        self._state.reader.unregister(address)

    @contextlib.contextmanager
    def _using(self, client, desc: Descriptors):
        """:meth:`_use` for the block; then :meth:`_release`, after ``uses.late`` (Mooncake
        calls given up) where the block set it (``uses.late`` is then the release's
        future)."""
        used = self._use(client, desc)
        uses = _Uses()
        try:
            yield uses
        finally:
            uses.late = self._release(used, uses.late)

    def _use(self, client, desc: Descriptors) -> list[int]:
        """Register the memory of ``desc`` if needed, and count this call as a user of its
        registered regions (``unregister`` refuses them meanwhile) until :meth:`_release`
        of what this returns."""
        state = self._state
        with self._register_lock:
            registered = state.registered
            if state.stale or any(registered.get(a) != n for a, n in desc.regions):
                self._register(client, desc.staging if desc.staging is not None
                               else desc.regions)
            used = [a for a, _ in desc.regions] or self._regions_touched(desc)
            for address in used:
                state.in_use[address] += 1
        return used

    def _release(self, used: list[int], late: Future | None) -> Future | None:
        """Stop using the regions ``used`` (:meth:`_use`): now, or once ``late`` (Mooncake
        calls given up on them) completes; then the future of that release, which
        completes once the regions are let go of."""
        if late is not None and not late.done():
            released: Future = Future()
            late.add_done_callback(lambda _f: (self._let_go(used), released.set_result(None)))
            return released
        self._let_go(used)
        return None

    def _let_go(self, used: list[int]) -> None:
        in_use = self._state.in_use
        with self._register_lock:
            for address in used:
                in_use[address] -= 1
                if not in_use[address]:
                    del in_use[address]

    def _regions_touched(self, desc: Descriptors) -> list[int]:
        """The registered regions that spans of ``desc`` start in (for descriptors built
        from lists, which name no regions). The caller holds ``_register_lock``."""
        if not desc.ptrs or not self._state.registered:
            return []
        starts = np.fromiter((p for row in desc.ptrs for p in row), dtype=np.uint64)
        return [a for a, n in self._state.registered.items()
                if bool(((starts >= a) & (starts < a + n)).any())]

    # -- bounded Mooncake calls ------------------------------------------------------------
    def _bounded(self, fn: Callable, *args, spans: int = 0, timeout: float | None = None,
                 here: bool = False) -> CallOutcome:
        """Run one Mooncake call, waiting at most ``timeout`` (``config.call_timeout``)
        seconds once it started; ``spans`` of it count against its client's span budget
        until it really returns (waiting for room there gives up when no call of the client
        returned for ``timeout``). A call given up is logged with its cause and its client
        replaced (for data calls), see the module docstring. ``here``: the call runs on
        this thread, watched (:func:`call_watched`): given up at the same bound, logged and
        its client replaced then, but this returns only once it has returned."""
        timeout = self.config.call_timeout if timeout is None else timeout
        client = getattr(fn, "__self__", None)
        budget = self._budgets.get(id(client)) if spans else None
        t0 = time.monotonic()
        taken = 0
        if budget is not None:
            taken = budget.acquire(spans, timeout)
            if not taken:
                log.warning("Mooncake %s not started: %d of %d spans of this client stayed in "
                            "flight and none returned for %.1f s",
                            getattr(fn, "__name__", "call"), budget.in_flight, budget.limit,
                            timeout)
                return CallOutcome(False, seconds=time.monotonic() - t0)
        if here:
            try:
                return call_watched(fn, *args, timeout=timeout, on_late=lambda late: (
                    self._given_up(fn, client, late, spans, timeout)))
            finally:
                if taken:
                    budget.release(taken)
        started = start_call(fn, *args,
                             on_return=(lambda: budget.release(taken)) if taken else None)
        return self._outcome(fn, started, spans, timeout)

    def _outcome(self, fn: Callable, started: StartedCall, spans: int = 0,
                 timeout: float | None = None) -> CallOutcome:
        """The outcome of a Mooncake call :meth:`_bounded` (or a query started early)
        started, waited for until ``timeout`` after its start; a call given up is logged,
        and its client replaced where it moves data."""
        timeout = self.config.call_timeout if timeout is None else timeout
        outcome = started.outcome(timeout)
        if not outcome.done:
            self._given_up(fn, getattr(fn, "__self__", None), outcome.late, spans, timeout)
        return outcome

    def _given_up(self, fn: Callable, client, late, spans: int, timeout: float) -> None:
        """Bookkeeping and log of a call given up; a data call's client is replaced (in the
        background: a new client's set-up must not delay this call)."""
        name = getattr(fn, "__name__", "call")
        state = self._state
        with self._lock:
            state.late.add(late)
            state.late_on[id(client)] += 1
        late.add_done_callback(lambda f: self._late_returned(f, client))
        data = name in _DATA_CALLS
        log.warning(
            "Mooncake %s%s gave no answer within %.1f s (a holder stalled, or the transport "
            "is stuck); its keys are FAILED%s", name, f" of {spans} spans" if spans else "",
            timeout, "; the memory it names stays in use until it returns (Mooncake's cap is "
            "60 s), and the client is replaced" if data else "")
        if data and client is not None:
            threading.Thread(target=self._replace_client, args=(client,),
                             name="kvmove-store-replace", daemon=True).start()

    def _late_returned(self, future, client) -> None:
        state = self._state
        with self._lock:
            state.late.discard(future)
            if _count_down(state.late_on, id(client)):
                return
        log.info("a Mooncake call given up earlier has returned")
        self._finish_if_unused(client)

    def _finish_if_unused(self, client) -> None:
        """Close ``client`` (in the background: a close takes a while) if it was retired and
        nothing runs on it any more: no store call holds it (``users``) and no call given
        up on it is still running (``late_on``). Checked under ``_lock``, where the swap to a
        new client happens too, so once both counts are zero on a retired client they stay
        zero (only a user can give up a call, and no new user gets a retired client)."""
        state = self._state
        with self._lock, state.retired_lock:
            if state.users[id(client)] or state.late_on[id(client)]:
                return
            retired = next((r for r in state.retired if r.client is client), None)
        if retired is not None:
            default_runner().submit(self._finish_retired, retired)

    def _replace_client(self, old) -> None:
        """A new client (no segment of its own) with every region registered again, in place
        of ``old``; ``old`` is retired (see :class:`_Retired`)."""
        with self._replace_lock:
            state = self._state
            if self._closed or state.client is not old:
                return
            config = self.config.replace(global_segment_size=0, connect_timeout=min(
                self.config.connect_timeout, 1.0))
            try:  # probes the master first: setup() against a silent one would freeze us
                new = self._connect(config, None)
            except Exception as e:
                log.warning("could not open a replacement Mooncake client (%s); the current "
                            "one stays in use until a later call given up tries again", e)
                return
            with self._register_lock:
                for address, nbytes in state.registered.items():
                    rc = new.register_buffer(address, nbytes)
                    if rc != 0:
                        log.warning("replacement client: register_buffer(%#x) failed with %d; "
                                    "the current client stays in use", address, rc)
                        with contextlib.suppress(Exception):
                            new.close()
                        return
                self._budgets[id(new)] = SpanBudget(self.limits.inflight_spans)
                holds = old is self._segment_client
                retired = _Retired(old, list(state.registered), holds)
                with self._lock, state.retired_lock:  # calls from now on get the new one
                    state.retired.append(retired)
                    state.client = self._client = new
            log.warning("replaced the Mooncake client after a call was given up (%d client(s) "
                        "retired%s)", len(state.retired),
                        "; the first keeps this process's segment" if holds else "")
        self._finish_if_unused(old)  # else its last user, or its last late call, does

    def _finish_retired(self, retired: _Retired) -> None:
        """A retired client that nothing runs on any more (:meth:`_finish_if_unused`):
        unregister its regions and close it, unless it holds this process's segment (closed
        with the store) or the master does not answer (a close would block for seconds; the
        store's close does it). Safe to run twice, and beside the store's close: whoever
        takes the client out of ``state.retired`` (under ``retired_lock``) closes it."""
        state = self._state
        closing = not retired.holds_segment and \
            _master_silence(*_split_address(self.address), 0.5) is None
        with self._register_lock, state.retired_lock:
            client = retired.client
            if client is None or retired not in state.retired:  # the store closed it
                return
            for address in retired.regions:
                with contextlib.suppress(Exception):
                    client.unregister_buffer(address)
            retired.regions = []
            self._budgets.pop(id(client), None)
            if not closing:
                return
            state.retired.remove(retired)
            retired.client = None
        try:
            client.close()
        except Exception:
            log.exception("closing a retired Mooncake client raised")

    # -- calls -----------------------------------------------------------------------------
    def _batch(self, fn: Callable, keys: list[str], *args, here: bool = False,
               spans: int | None = None) -> list[int]:
        """One Mooncake batch call, bounded: its per-key results; ``CLIENT_EXCEPTION`` for
        every key when it raises; ``CALL_TIMEOUT`` for every key when it was given up (then
        the list's ``late`` is its future, for a data call, unless it ran ``here``:
        :meth:`_bounded`); ``StoreError`` when it answers for a different number of keys.
        ``spans``: a data call's spans, where the caller knows them (counted otherwise)."""
        data = getattr(fn, "__name__", "") in _DATA_CALLS
        if data and spans is None:
            spans = sum(map(len, args[0]))
        outcome = self._bounded(fn, keys, *args, spans=spans if data else 0, here=here)
        return self._batch_codes(fn, keys, outcome, data)

    @staticmethod
    def _batch_codes(fn: Callable, keys: list[str], outcome: CallOutcome, data: bool
                     ) -> list[int]:
        """The per-key codes of a batch call's ``outcome`` (see :meth:`_batch`)."""
        if not outcome.done:
            return _Codes([CALL_TIMEOUT] * len(keys), outcome.late if data else None)
        if outcome.error is not None:
            log.error("Mooncake %s of %d keys raised; marking them failed", fn.__name__,
                      len(keys), exc_info=outcome.error)
            return [CLIENT_EXCEPTION] * len(keys)
        result = outcome.value
        if len(result) != len(keys):
            raise StoreError(
                f"Mooncake {fn.__name__} answered {len(result)} results for {len(keys)} keys "
                f"(first key {keys[0]!r}); refusing to guess which keys they belong to"
            )
        return list(result)

    def _key_chunks(self, n: int) -> list[slice]:
        step = self.config.max_batch_keys
        return [slice(a, min(a + step, n)) for a in range(0, n, step)]

    def _span_chunks(self, desc: Descriptors) -> list[slice]:
        """Consecutive keys of ``desc`` cut into calls of at most ``max_batch_keys`` keys,
        ``limits.call_spans`` spans and ``limits.call_bytes`` bytes (a key larger than that
        goes alone)."""
        n, step = len(desc), self.config.max_batch_keys
        cap, most = self.limits.call_spans, self.limits.call_bytes
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

    def _chunked(self, chunks: list[slice], run: Callable[[slice], list[int]]) -> _Codes:
        """The per-key codes of ``run(chunk)`` over ``chunks``, with the futures of calls
        given up joined in ``late``. Chunks run in order, ``limits.side_by_side`` at a time
        (one, measured faster) as far as the client's spans in flight allow
        (``inflight_spans // call_spans``). When every key of a chunk fails with an RPC error
        the master is unreachable (each further call would wait ~4 s for Mooncake to
        reconnect), and when a call was given up the transport or master is stuck: either
        way the chunks not started yet get that code untried."""
        if len(chunks) == 1:  # the usual case: one call, on this thread, nothing untried
            part = run(chunks[0])
            return _Codes(part, settled([getattr(part, "late", None)]),
                          getattr(part, "late_puts", ()))
        n = chunks[-1].stop if chunks else 0
        width = min(len(chunks), self.limits.side_by_side,
                    max(1, self.limits.inflight_spans // self.limits.call_spans))
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
                if _stops_the_call(part):
                    with lock:
                        stop.append(part[0] if _unreachable(part) else CALL_TIMEOUT)
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
            untried = sum(c.stop - c.start for c, p in zip(chunks, parts, strict=True)
                          if p is None)
            log.warning("%s; %d keys not tried", f"master {self.address} unreachable "
                        f"({code_name(stop[0])})" if stop[0] != CALL_TIMEOUT else
                        "a Mooncake call was given up", untried)
        assert len(codes) == n
        return _Codes(codes, settled(getattr(p, "late", None) for p in parts),
                      [lp for p in parts for lp in getattr(p, "late_puts", ())])

    @staticmethod
    def _check_desc(desc) -> Descriptors:
        if not isinstance(desc, Descriptors):
            raise TypeError(f"expected kvmove.Descriptors (from describe()), got {type(desc)}")
        return desc

    def put(self, desc: Descriptors, *, detect_exists: bool | None = None,
            until_returned: bool = False) -> StoreResult:
        """Store each key's spans as one object. One :class:`Status` per key (``OK``,
        ``EXISTS``, ``NO_SPACE`` or ``FAILED``); ``.codes`` holds Mooncake's codes,
        ``.late`` the calls given up (module docstring).

        ``detect_exists`` (default ``config.detect_exists``): ask the master first which
        keys exist, to report them ``EXISTS`` and not send them. Without it a stored key
        is reported ``OK`` (Mooncake keeps the stored object either way).

        ``until_returned=True``: as :meth:`get`'s, for a caller that would wait for
        ``.late`` anyway; the put runs on this thread, given up at ``call_timeout`` from
        its own start, and ``.late`` is ``None`` (``.late_stored`` still says what a put
        given up stored). The exists check, which names no memory, is still handed off
        and answered at its bound (a check given up starts no put)."""
        desc = self._check_desc(desc)
        if not isinstance(until_returned, bool):
            raise TypeError(f"until_returned must be a bool, got {until_returned!r}")
        check = self.config.detect_exists if detect_exists is None else bool(detect_exists)
        with self._call_slot() as client:
            return self._put(client, desc, check, None, until_returned)

    def begin_put(self, keys: Sequence[str], *, detect_exists: bool | None = None
                  ) -> PendingPut:
        """Start a put of ``keys`` whose descriptors are not made yet: the master is asked
        which of them exist (``detect_exists``, as :meth:`put`) now, on a background
        thread, while the caller makes the descriptors; ``PendingPut.put(desc)`` then
        sends the others. Use it as a context manager: it holds a client until it ends.
        The check is started early for up to ``config.max_batch_keys`` keys (a longer
        put checks per call, as :meth:`put` does). Raises :class:`StoreError` when the
        store is closed."""
        keys = check_keys(keys, unique=False)
        check = self.config.detect_exists if detect_exists is None else bool(detect_exists)
        client = self._take_client()
        try:
            early = check and 0 < len(keys) <= self.config.max_batch_keys
            query = start_call(client.batch_is_exist, keys) if early else None
        except BaseException:
            self._drop_client(client)
            raise
        return PendingPut(self, client, keys, check, query)

    def _put(self, client, desc: Descriptors, check: bool, flags: list[int] | None,
             here: bool = False) -> StoreResult:
        """A put on ``client``; ``flags``: the exists check's answer for ``desc``'s keys,
        when it was asked already (a check that stops the call ends every key with its
        code, nothing sent); ``here``: the calls run on this thread (:meth:`_bounded`)."""
        with self._using(client, desc) as uses:
            if flags is not None and _stops_the_call(flags):
                codes = _Codes(flags)
            else:
                codes = self._chunked(self._span_chunks(desc), lambda c: self._put_chunk(
                    client, desc[c], check, None if flags is None else flags[c], here))
            uses.late = codes.late
        statuses = [Status.OK] * len(codes) if not any(codes) else map(_put_status, codes)
        result = StoreResult(statuses, codes, uses.late, _stored_late(codes.late_puts, uses.late))
        self._log_outcome("put", desc.keys, result)
        return result

    def _put_chunk(self, client, part: Descriptors, detect_exists: bool,
                   flags: list[int] | None = None, here: bool = False) -> list[int]:
        first = None  # the first put's codes, when the check's own call made it
        if detect_exists:
            if flags is None and here:
                # The check names no memory: handed to the runner, given up at the bound
                # (no put then), never waited for past it; the put runs here.
                flags = self._batch(client.batch_is_exist, part.keys)
            elif flags is None:
                flags, first = self._check_then_put(client, part)
            if _stops_the_call(flags):
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
        return _Codes(codes, settled(late), late_puts)

    def _check_then_put(self, client, part: Descriptors
                        ) -> tuple[list[int], list[int] | None]:
        """The exists check of ``part``'s keys and, when none exists, the put of all of
        them, in one call on a runner (one thread hand-off, not two: on a busy machine each
        costs a scheduling delay). Each half is bounded as its own call would be: the check
        by ``call_timeout`` from its start (given up then, the put never starts), the put by
        ``call_timeout`` from its own start. Returns the check's codes and the put's codes
        (None when it was not made: some key exists, the check failed, or the client's
        spans in flight left no room for the put when the check ended: then the caller puts
        as a put does, waiting for room)."""
        keys, spans, timeout = part.keys, part.num_spans, self.config.call_timeout
        gate = _PutGate(self._budgets.get(id(client)), spans)
        started = start_call(_check_then_put, client, gate, keys, part.ptrs, part.sizes,
                             self._replicate)
        check, put = client.batch_is_exist, client.batch_put_from_multi_buffers
        outcome = started.outcome(timeout)
        if not outcome.done:
            put_began = gate.close()
            if put_began is not None:  # the put's own bound runs from its start
                outcome = started.outcome(timeout + put_began - started.started)
            if not outcome.done:
                if put_began is None:
                    self._given_up(check, client, outcome.late, 0, timeout)
                    return self._batch_codes(check, keys, outcome, data=False), None
                late = _put_codes_when_done(outcome.late)
                self._given_up(put, client, late, spans, timeout)
                return [0] * len(keys), self._batch_codes(
                    put, keys, CallOutcome(False, late=late), data=True)
        if outcome.error is not None:  # the check raised (a put's error is returned)
            return self._batch_codes(check, keys, outcome, data=False), None
        flags, codes, error = outcome.value
        flags = self._batch_codes(check, keys, CallOutcome(True, value=flags), data=False)
        if codes is None and error is None:
            return flags, None
        return flags, self._batch_codes(put, keys, CallOutcome(True, value=codes, error=error),
                                        data=True)

    def get(self, desc: Descriptors, *, until_returned: bool = False) -> StoreResult:
        """Read each key's object into its spans. One :class:`Status` per key: ``OK`` only
        when the object is exactly the described size; ``MISS``, ``SIZE_MISMATCH`` or
        ``FAILED`` otherwise. ``.codes`` holds Mooncake's results (byte counts or codes),
        ``.late`` the calls given up (module docstring). A key whose holder is dead is read
        from another live replica in the same call, where it has one.

        ``until_returned=True``, for a caller that would wait for ``.late`` anyway (memory
        that goes back only once Mooncake let go of it): the reads run on this thread, no
        hand-off to another (0.1-0.2 ms less per call on a busy host). A read is still given
        up at ``call_timeout`` (logged, its keys ``FAILED`` with ``CALL_TIMEOUT``, the client
        replaced), but the call returns only once Mooncake has (its own cap is 60 s; no
        bound of kvmove's applies), a replica failover's reads given up included, and
        ``.late`` is then ``None``."""
        desc = self._check_desc(desc)
        if not isinstance(until_returned, bool):
            raise TypeError(f"until_returned must be a bool, got {until_returned!r}")
        expected = desc.object_sizes()
        # _call_slot and _using spelled out: the hot path of a load (each context
        # manager's frames cost a few µs on a cold cache)
        client = self._take_client()
        try:
            used = self._use(client, desc)
            late = None
            try:
                chunks = self._span_chunks(desc)
                if len(chunks) == 1:  # the usual case: one call on this thread
                    codes = self._get_chunk(client, desc, until_returned)
                else:
                    codes = self._chunked(chunks, lambda c: self._get_chunk(
                        client, desc[c], until_returned))
                if codes == expected:  # the common case: every key read in full, in time
                    result = StoreResult([Status.OK] * len(codes), codes)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("get of %d keys: %s", len(codes), result.summary())
                    return result
                given_up = [getattr(codes, "late", None)]
                if TRANSFER_FAIL in codes:
                    given_up.append(self._failover(client, desc, codes))
                late = settled(given_up)
                statuses = self._get_statuses(client, desc.keys, codes, expected)
            finally:
                late = self._release(used, late)
        finally:
            self._drop_client(client)
        if until_returned and late is not None:  # a failover's read given up
            wait_until_returned(late)  # once the read has, and its regions are released
            late = None
        result = StoreResult(statuses, codes, late)
        self._log_outcome("get", desc.keys, result)
        return result

    def _get_chunk(self, client, part: Descriptors, here: bool = False) -> list[int]:
        codes = self._batch(client.batch_get_into_multi_buffers, part.keys, part.ptrs,
                            part.sizes, here=here, spans=part.num_spans)
        retry = ([i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
                 if LEASE_EXPIRED in codes else None)  # the scan in C first: mostly none
        if retry:
            sub = part.select(retry)
            again = self._batch(client.batch_get_into_multi_buffers, sub.keys, sub.ptrs,
                                sub.sizes, here=here, spans=sub.num_spans)
            for i, code in zip(retry, again, strict=True):
                codes[i] = code
            if getattr(again, "late", None) is not None:
                return _Codes(codes, settled([getattr(codes, "late", None), again.late]))
        return codes

    def _get_statuses(self, client, keys: list[str], codes: list[int],
                      expected: list[int]) -> list[Status]:
        """Each key's status from its get code. A ``-600``/``-800`` is told apart by asking
        the master ``get_size(key)`` (bounded), one key after the other; once one question
        is given up or the master is unreachable, the keys left are not asked (each would
        wait as long again) and end as an unanswered question does."""
        statuses, ask = [], True
        for key, code, size in zip(keys, codes, expected, strict=True):
            stored = CLIENT_EXCEPTION  # the object's stored size, when asked and answered
            if ask and code in (INVALID_PARAMS, TRANSFER_FAIL):
                asked = self._bounded(client.get_size, key)
                if asked.done and asked.error is None:
                    stored = asked.value
                ask = asked.done and stored not in (RPC_FAIL, RPC_TIMEOUT)
            statuses.append(self._get_status(code, size, stored))
        return statuses

    @staticmethod
    def _get_status(code: int, size: int, stored: int) -> Status:
        """A key's status from its get ``code``, its described ``size`` and, for ``-600`` and
        ``-800``, its ``stored`` size (``get_size``; negative: not known)."""
        if code == size:
            return Status.OK
        if code >= 0:
            return Status.SIZE_MISMATCH
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return Status.MISS
        if code in (INVALID_PARAMS, TRANSFER_FAIL):
            if stored == OBJECT_NOT_FOUND:
                return Status.MISS
            if stored >= 0:
                return Status.FAILED if stored == size else Status.SIZE_MISMATCH
            return Status.SIZE_MISMATCH if code == INVALID_PARAMS else Status.FAILED
        return Status.FAILED

    # -- replica failover ------------------------------------------------------------------
    def _replica_reader(self) -> ReplicaReader | None:
        """The store's replica reader, made on first use with every registered region; None
        (logged) when it cannot be made (tried again after 30 s)."""
        state = self._state
        if state.reader is not None:
            return state.reader
        if time.monotonic() - self._reader_failed_at < 30.0:
            return None
        with self._register_lock:
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
                    self._reader_failed_at = time.monotonic()
                    return None
                state.reader = reader
        return state.reader

    def _reader_register(self, address: int, nbytes: int) -> None:
        try:
            self._state.reader.register(address, nbytes)
        except StoreError as e:
            log.warning("%s (replica failover cannot read into that region)", e)

    def _failover(self, client, desc: Descriptors, codes: list[int]):
        """Read each key whose get failed in transport (``TRANSFER_FAIL``) from another
        complete replica on a live holder, into the key's own spans; set its code to the
        object size when read and confirmed. Returns the future of reads given up, or None.
        """
        idx = [i for i, c in enumerate(codes) if c == TRANSFER_FAIL]
        reader = self._replica_reader()
        if reader is None or not idx:
            return None
        t0 = time.monotonic()
        keys = [desc.keys[i] for i in idx]
        leased = self._bounded(client.batch_is_exist, keys)  # a read leases the keys
        if not leased.done:  # the master is stuck: listing would wait as long again
            log.warning("replica failover: the master did not answer for %d keys within the "
                        "bound; not tried", len(keys))
            return None
        listed = self._bounded(client.batch_get_replica_desc, keys)
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
            for group in self._replica_groups(desc, items):
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
            confirm = self._bounded(client.batch_get_replica_desc,
                                    [desc.keys[i] for i, _ in read])
            if confirm.done and confirm.error is None:
                for i, replica in read:
                    if replica in replicas_of(confirm.value.get(desc.keys[i])):
                        codes[i] = replica.size
        recovered = sum(1 for i in idx if codes[i] == desc.nbytes(i))
        # Nothing to say where no key had a replica to try (a failed transfer with one
        # replica, or an object of another size than its destination).
        log.log(logging.WARNING if plan else logging.DEBUG,
                "replica failover: %d of %d keys whose holder failed read from a live "
                "replica in %.2f s", recovered, len(idx), time.monotonic() - t0)
        return settled(late)

    def _replica_groups(self, desc: Descriptors, items: list) -> list[list]:
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

    # -- queries ---------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> StoreResult:
        """Whether each key is stored (``True``/``False``; a key the master could not
        answer for is ``False``, its code in ``.codes`` is negative)."""
        keys = check_keys(keys, unique=False)
        with self._call_slot() as client:
            codes = self._chunked(self._key_chunks(len(keys)),
                                  lambda c: self._batch(client.batch_is_exist, keys[c]))
        errors = [c for c in codes if c < 0]
        if errors:
            log.warning("exists: %d of %d keys unanswered (%s)", len(errors), len(keys),
                        code_name(errors[0]))
        return StoreResult([c == 1 for c in codes], codes)

    def replicas(self, keys: Sequence[str]) -> list[list[Replica]]:
        """Where each key's memory replicas live, in the master's order (a get reads the
        first): one list of :class:`~kvmove.store.replica_reader.Replica` (``endpoint``,
        ``address``, ``size``, ``complete``) per key; ``[]`` for a key that is not stored,
        and for every key when the master did not answer (logged)."""
        keys = check_keys(keys, unique=False)
        if not keys:
            return []
        with self._call_slot() as client:
            out = self._bounded(client.batch_get_replica_desc, keys)
        if not out.done or out.error is not None:
            log.warning("replicas: the master did not list the replicas of %d keys (%s)",
                        len(keys), out.error or "no answer")
            return [[] for _ in keys]
        return [replicas_of(out.value.get(k)) for k in keys]

    def remove(self, keys: Sequence[str], *, force: bool = False) -> StoreResult:
        """Remove keys. ``OK``, ``MISS`` (no such key) or ``FAILED`` per key; a key read
        within the master's lease time (``-706``) is kept unless ``force``."""
        keys = check_keys(keys, unique=False)
        with self._call_slot() as client:
            codes = self._chunked(self._key_chunks(len(keys)),
                                  lambda c: self._batch(client.batch_remove, keys[c],
                                                        bool(force)))
        result = StoreResult(map(_remove_status, codes), codes)
        self._log_outcome("remove", keys, result)
        return result

    @staticmethod
    def _log_outcome(op: str, keys: list[str], result: StoreResult) -> None:
        if Status.FAILED in result:
            failed = [i for i, s in enumerate(result) if s is Status.FAILED]
            names = Counter(code_name(result.codes[i]) for i in failed)
            log.warning("%s: %d of %d keys failed (%s); first %r", op, len(failed), len(keys),
                        ", ".join(f"{k} x{v}" for k, v in names.items()), keys[failed[0]])
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s of %d keys: %s", op, len(keys), result.summary())


class PendingPut:
    """A put begun by :meth:`MooncakeStore.begin_put`: its exists check runs while the
    caller makes the descriptors. :meth:`put` may be called for any of its keys (in any
    order, a subset too); leaving the ``with`` block (or :meth:`close`) lets its client go,
    after waiting, bounded, for a check no put collected. It must be closed:
    ``store.close()`` waits for it. Its calls may come from any thread, one at a time
    (a ``close`` waits for a ``put`` in progress).

    The check answers for the moment it ran: a key removed (or evicted by the master)
    between the check and the put ends ``EXISTS`` unsent, as a key removed just after a
    put would be gone too."""

    def __init__(self, store: MooncakeStore, client, keys: list[str], check: bool,
                 query: StartedCall | None):
        self._store = store
        self._client = client
        self.keys = keys
        self._check = check
        self._query = query
        self._flags: list[int] | None = None
        self._closed = False
        self._lock = threading.Lock()

    def _answer(self) -> list[int] | None:
        """The exists check's codes for :attr:`keys` (taken once), or None when it was not
        started early. The caller holds ``_lock``."""
        query, self._query = self._query, None
        if query is not None:
            fn = self._client.batch_is_exist
            self._flags = self._store._batch_codes(fn, self.keys,
                                                   self._store._outcome(fn, query), data=False)
        return self._flags

    def put(self, desc: Descriptors) -> StoreResult:
        """:meth:`MooncakeStore.put` of ``desc``, whose keys must be among :attr:`keys`
        (else ``ValueError``, before anything is sent)."""
        desc = self._store._check_desc(desc)
        where = None
        if desc.keys != self.keys:
            where = {k: i for i, k in enumerate(self.keys)}
            missing = next((k for k in desc.keys if k not in where), None)
            if missing is not None:
                raise ValueError(f"desc holds key {missing!r}, which this PendingPut was not "
                                 f"begun with")
        with self._lock:
            if self._closed:
                raise StoreError("put() of a PendingPut that has ended")
            flags = self._answer()
            if flags is not None and where is not None:
                flags = [flags[where[k]] for k in desc.keys]
            return self._store._put(self._client, desc, self._check, flags)

    def close(self) -> None:
        """Let the client go (idempotent), once the exists check has returned or was given
        up (bounded by ``call_timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._answer()
            except StoreError as e:  # a broken answer no put asked for
                log.warning("exists check of a put begun and not made: %s", e)
            finally:
                self._store._drop_client(self._client)

    def __enter__(self) -> PendingPut:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
