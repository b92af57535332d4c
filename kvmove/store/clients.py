"""The store's Mooncake client, its bounded calls and its replacement. Every Mooncake call is
waited for at most ``call_timeout`` seconds; a data call that timed out may leave its client
broken towards that holder (a wedged TCP queue), so the client is replaced by a new one (no
segment of its own) with the same regions registered. Calls already running on the old
client finish there; it is closed once none runs on it and its abandoned calls have
returned. See ``docs/API.md``, "The store"."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future

from kvmove.errors import StoreError
from kvmove.store.bounded_call import (
    CallOutcome,
    SpanBudget,
    StartedCall,
    call_watched,
    default_runner,
    start_call,
)
from kvmove.store.config import StoreConfig
from kvmove.store.embedded_master import EmbeddedMaster
from kvmove.store.master_probe import master_silence, open_client, split_address
from kvmove.store.transport_limits import TransportLimits

log = logging.getLogger(__name__)

# The Mooncake calls that move bytes (their spans count against the transport's queue).
DATA_CALLS = frozenset({"batch_put_from_multi_buffers", "batch_get_into_multi_buffers"})
# Seconds close() waits for calls in flight past their bound to return (Mooncake's own cap
# is 60 s).
LATE_CLOSE_WAIT_S = 75.0


class Retired:
    """A client replaced after a call on it timed out: kept until its abandoned calls have
    returned (and, while it holds this process's segment, until the store closes)."""

    def __init__(self, client, regions: list[int], holds_segment: bool):
        self.client = client
        self.regions = regions
        self.holds_segment = holds_segment


def count_down(counter: Counter, key) -> int:
    """Decrement ``counter[key]``, dropping the entry at zero (ids are reused); what is left."""
    left = counter.get(key, 0) - 1
    if left <= 0:
        counter.pop(key, None)
    else:
        counter[key] = left
    return left


class ClientState:
    """What closing needs, held apart from the store so a finalizer can close it."""

    def __init__(self, client, master: EmbeddedMaster | None):
        self.client = client
        self.master = master
        self.register_lock = threading.Lock()  # guards the regions (and a client's swap)
        self.registered: dict[int, int] = {}  # address -> nbytes
        self.in_use: Counter = Counter()  # address -> put/get calls using the region now
        self.stale: deque = deque()  # regions of garbage-collected staging buffers
        self.retired: list[Retired] = []  # replaced clients not closed yet
        self.retired_lock = threading.Lock()  # guards ``retired`` (and a retired client's close)
        # Who runs on which client (guarded by ``Clients.lock``): a replaced client is
        # closed only once neither count has it.
        self.users: Counter = Counter()  # id(client) -> store calls using it
        self.late: set = set()  # futures of Mooncake calls that timed out, still running
        self.late_on: Counter = Counter()  # id(client) -> its abandoned calls still running
        self.reader = None  # the ReplicaReader of failover reads (made on first use)


def wait_late(state: ClientState, timeout: float) -> None:
    """Wait (bounded) for the Mooncake calls that timed out to return before closing."""
    late = [f for f in list(state.late) if not f.done()]
    if not late:
        return
    log.warning("closing the store: waiting up to %.0f s for %d Mooncake call(s) that timed "
                "out earlier to return", timeout, len(late))
    deadline = time.monotonic() + timeout
    for f in late:
        with contextlib.suppress(Exception):
            f.result(max(0.0, deadline - time.monotonic()))


def shutdown(state: ClientState) -> None:
    """Unregister every region, close the clients, stop the embedded master. Runs once, from
    close() or a finalizer. Against a master that is gone, Mooncake's ``close()`` blocks for
    10-20 s holding the GIL: an embedded master that died is restarted on its port first."""
    client, state.client = state.client, None
    if client is None:
        return
    wait_late(state, LATE_CLOSE_WAIT_S)
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


class Clients:
    """The current client and the ones replaced: who uses which (:meth:`take`,
    :meth:`drop`), bounded calls on them (:meth:`bounded`), and the replacement of a client
    whose data call timed out (``replace_later(client)``, the store's hook, starts
    :meth:`replace` on a thread of its own)."""

    def __init__(self, config: StoreConfig, limits: TransportLimits, client,
                 master: EmbeddedMaster | None, replace_later: Callable[[object], None]):
        self.config, self.limits = config, limits
        # Guards the client, the counts of calls in flight and the close (a C lock: taken
        # twice per call); close() waits on _calls_done for the calls in flight.
        self.lock = threading.RLock()
        self._calls_done = threading.Condition(self.lock)
        self.in_flight = 0
        self.closed = False
        self.budgets = {id(client): SpanBudget(limits.inflight_spans)}
        self._replace_lock = threading.Lock()
        self._segment_client = client if config.global_segment_size > 0 else None
        self._replace_later = replace_later
        self.state = ClientState(client, master)

    # -- who uses which client -------------------------------------------------------------
    def take(self):
        """The current client, counted as a user (and a call in flight, which :meth:`close`
        waits for) until :meth:`drop`."""
        with self.lock:
            if self.closed:
                raise StoreError(f"the store at {self.config.master_address} is closed")
            self.in_flight += 1
            client = self.state.client
            users = self.state.users  # dict.get: a Counter's missing key is a Python call
            users[id(client)] = users.get(id(client), 0) + 1
        return client

    def drop(self, client) -> None:
        with self.lock:
            self.in_flight -= 1
            if self.in_flight == 0 and self.closed:  # close() waits for the last one
                self._calls_done.notify_all()
            last = (not count_down(self.state.users, id(client))
                    and client is not self.state.client)
        if last:  # of a replaced client
            self.finish_if_unused(client)

    @contextlib.contextmanager
    def slot(self):
        """The current client for the block: a put/get of several chunks keeps using the
        client it started with even if it is replaced meanwhile."""
        client = self.take()
        try:
            yield client
        finally:
            self.drop(client)

    def close(self) -> bool:
        """Refuse new calls and wait for those in flight (and a replacement being set up);
        False when closed already."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            while self.in_flight:
                self._calls_done.wait()
        with self._replace_lock:  # a replacement being set up finishes first
            pass
        return True

    # -- bounded calls ---------------------------------------------------------------------
    def bounded(self, fn: Callable, *args, spans: int = 0, timeout: float | None = None,
                here: bool = False) -> CallOutcome:
        """Run one Mooncake call, waiting at most ``timeout`` (``call_timeout``) seconds once
        it started; its ``spans`` count against its client's budget until it really returns
        (waiting for room times out when no call of the client returned for ``timeout``).
        ``here``: it runs on this thread, watched, and this returns only once it returned."""
        timeout = self.config.call_timeout if timeout is None else timeout
        client = getattr(fn, "__self__", None)
        budget = self.budgets.get(id(client)) if spans else None
        taken = 0
        if budget is not None:
            t0 = time.monotonic()
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
                    self.timed_out(fn, client, late, spans, timeout)))
            finally:
                if taken:
                    budget.release(taken)
        started = start_call(fn, *args,
                             on_return=(lambda: budget.release(taken)) if taken else None)
        return self.outcome(fn, started, spans, timeout)

    def outcome(self, fn: Callable, started: StartedCall, spans: int = 0,
                timeout: float | None = None) -> CallOutcome:
        """The outcome of a started Mooncake call, waited for until ``timeout`` after its
        start; a call that timed out goes to :meth:`timed_out`."""
        timeout = self.config.call_timeout if timeout is None else timeout
        outcome = started.outcome(timeout)
        if not outcome.done:
            self.timed_out(fn, getattr(fn, "__self__", None), outcome.late, spans, timeout)
        return outcome

    def timed_out(self, fn: Callable, client, late: Future, spans: int, timeout: float
                  ) -> None:
        """Log a call that timed out and count it in flight until ``late`` completes; a data
        call's client is replaced (in the background: a set-up must not delay this call)."""
        name = getattr(fn, "__name__", "call")
        state = self.state
        with self.lock:
            state.late.add(late)
            state.late_on[id(client)] += 1
        late.add_done_callback(lambda f: self._late_returned(f, client))
        data = name in DATA_CALLS
        log.warning(
            "Mooncake %s%s gave no answer within %.1f s (a holder stalled, or the transport "
            "is stuck); its keys are FAILED%s", name, f" of {spans} spans" if spans else "",
            timeout, "; the memory it names stays in use until it returns (Mooncake's cap is "
            "60 s), and the client is replaced" if data else "")
        if data and client is not None:
            threading.Thread(target=self._replace_later, args=(client,),
                             name="kvmove-store-replace", daemon=True).start()

    def _late_returned(self, future, client) -> None:
        state = self.state
        with self.lock:
            state.late.discard(future)
            if count_down(state.late_on, id(client)):
                return
        log.info("a Mooncake call that timed out earlier has returned")
        self.finish_if_unused(client)

    # -- replacement -----------------------------------------------------------------------
    def finish_if_unused(self, client) -> None:
        """Close ``client`` (in the background) if it was replaced and nothing runs on it: no
        store call holds it and none of its abandoned calls still runs. Checked under
        ``lock``, where the swap happens too, so both counts stay zero once they are."""
        state = self.state
        with self.lock, state.retired_lock:
            if state.users[id(client)] or state.late_on[id(client)]:
                return
            retired = next((r for r in state.retired if r.client is client), None)
        if retired is not None:
            default_runner().submit(self.finish_retired, retired)

    def replace(self, old) -> None:
        """A new client (no segment of its own) with every region registered again, in place
        of ``old``, when the master answers (else ``old`` stays, until the next call that
        times out tries again); ``old`` is kept as :class:`Retired` until nothing runs on it."""
        with self._replace_lock:
            state = self.state
            if self.closed or state.client is not old:
                return
            config = self.config.replace(global_segment_size=0, connect_timeout=min(
                self.config.connect_timeout, 1.0))
            try:  # probes the master first: setup() against a silent one would freeze us
                new = open_client(config, None)
            except Exception as e:
                log.warning("could not open a replacement Mooncake client (%s); the current "
                            "one stays in use until a later call that times out tries again",
                            e)
                return
            with state.register_lock:
                for address, nbytes in state.registered.items():
                    rc = new.register_buffer(address, nbytes)
                    if rc != 0:
                        log.warning("replacement client: register_buffer(%#x) failed with %d; "
                                    "the current client stays in use", address, rc)
                        with contextlib.suppress(Exception):
                            new.close()
                        return
                self.budgets[id(new)] = SpanBudget(self.limits.inflight_spans)
                holds = old is self._segment_client
                retired = Retired(old, list(state.registered), holds)
                with self.lock, state.retired_lock:  # calls from now on get the new one
                    state.retired.append(retired)
                    state.client = new
            log.warning("replaced the Mooncake client after a call timed out (%d replaced "
                        "client(s) not closed yet%s)", len(state.retired),
                        "; the first keeps this process's segment" if holds else "")
        self.finish_if_unused(old)  # else its last user, or its last abandoned call, does

    def finish_retired(self, retired: Retired) -> None:
        """Unregister a replaced client's regions and close it, unless it holds this
        process's segment (closed with the store) or the master does not answer (a close
        would block for seconds). Safe to run twice, and beside :func:`shutdown`: whoever
        takes the client out of ``state.retired`` (under ``retired_lock``) closes it."""
        state = self.state
        closing = not retired.holds_segment and \
            master_silence(*split_address(self.config.master_address), 0.5) is None
        with state.register_lock, state.retired_lock:
            client = retired.client
            if client is None or retired not in state.retired:  # the store closed it
                return
            for address in retired.regions:
                with contextlib.suppress(Exception):
                    client.unregister_buffer(address)
            retired.regions = []
            self.budgets.pop(id(client), None)
            if not closing:
                return
            state.retired.remove(retired)
            retired.client = None
        try:
            client.close()
        except Exception:
            log.exception("closing a replaced Mooncake client raised")
