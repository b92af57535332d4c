"""A put's exists check and its put: begun before the descriptors are made
(:class:`PendingPut`), or as one hand-off to a runner thread (:func:`check_then_put`), each
half bounded from its own start; a check that timed out starts no put."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kvmove.errors import StoreError
from kvmove.objects.descriptors import Descriptors
from kvmove.store.bounded_call import CallOutcome, SpanBudget, StartedCall, start_call
from kvmove.store.results import StoreResult, batch_codes, check_desc

log = logging.getLogger(__name__)

__all__ = ["PendingPut"]


class PutGate:
    """Whether the put of a :func:`check_then_put` may still start: not once its waiter
    stopped waiting for the check (:meth:`close`), nor while the client's spans in flight
    leave no room for the put's ``spans`` (taken from ``budget`` when it starts, released
    by :meth:`put_returned`: a check takes none, however long it runs)."""

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


def _check_and_put(client, gate: PutGate, keys, ptrs, sizes, replicate):
    """On a runner thread: the exists check of ``keys`` and then, when none of them exists
    and ``gate`` opens, the put of every key. ``(check codes, put codes or None, what the
    put raised or None)``; the check's own error is raised."""
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
    """A future of the put codes of a :func:`_check_and_put` call (what its put raised, as
    its exception), completing when ``call`` does."""
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


def check_then_put(client, part: Descriptors, *, budget: SpanBudget | None, replicate,
                   timeout: float, timed_out: Callable) -> tuple[list[int], list[int] | None]:
    """The exists check of ``part``'s keys and, when none exists, the put of all of them, in
    one call on a runner: the check bounded by ``timeout`` from its start, the put from its
    own. ``timed_out(fn, client, late, spans, timeout)`` hears of a half that timed out.
    Returns the check's codes and the put's (None when it was not made: some key exists, the
    check failed, or ``budget`` had no room when the check ended; the caller then puts)."""
    keys, spans = part.keys, part.num_spans
    gate = PutGate(budget, spans)
    started = start_call(_check_and_put, client, gate, keys, part.ptrs, part.sizes, replicate)
    check, put = client.batch_is_exist, client.batch_put_from_multi_buffers
    outcome = started.outcome(timeout)
    if not outcome.done:
        put_began = gate.close()
        if put_began is not None:  # the put's own bound runs from its start
            outcome = started.outcome(timeout + put_began - started.started)
        if not outcome.done:
            if put_began is None:
                timed_out(check, client, outcome.late, 0, timeout)
                return batch_codes(check, keys, outcome, data=False), None
            late = _put_codes_when_done(outcome.late)
            timed_out(put, client, late, spans, timeout)
            return [0] * len(keys), batch_codes(put, keys, CallOutcome(False, late=late),
                                                data=True)
    if outcome.error is not None:  # the check raised (a put's error is returned)
        return batch_codes(check, keys, outcome, data=False), None
    flags, codes, error = outcome.value
    flags = batch_codes(check, keys, CallOutcome(True, value=flags), data=False)
    if codes is None and error is None:
        return flags, None
    return flags, batch_codes(put, keys, CallOutcome(True, value=codes, error=error), data=True)


class PendingPut:
    """A put begun by :meth:`kvmove.MooncakeStore.begin_put`: its exists check runs while
    the caller makes the descriptors; :meth:`put` sends any of its keys. It must be closed
    (``with`` block, or :meth:`close`): it holds a client until then, and ``store.close()``
    waits for it. Calls may come from any thread, one at a time. The check answers for the
    moment it ran: a key removed between the check and the put ends ``EXISTS`` unsent.

    The store hands it ``put(desc, flags)`` (a put on its client, given the check's codes),
    ``outcome(fn, started)`` (a started call's bounded outcome) and ``release()``."""

    def __init__(self, keys: list[str], check_fn: Callable, query: StartedCall | None, *,
                 put: Callable[[Descriptors, list[int] | None], StoreResult],
                 outcome: Callable[[Callable, StartedCall], CallOutcome],
                 release: Callable[[], None]):
        self.keys = keys
        self._check_fn = check_fn
        self._query = query
        self._put, self._outcome, self._release = put, outcome, release
        self._flags: list[int] | None = None
        self._closed = False
        self._lock = threading.Lock()

    def _answer(self) -> list[int] | None:
        """The exists check's codes for :attr:`keys` (taken once), or None when it was not
        started early. The caller holds ``_lock``."""
        query, self._query = self._query, None
        if query is not None:
            fn = self._check_fn
            self._flags = batch_codes(fn, self.keys, self._outcome(fn, query), data=False)
        return self._flags

    def put(self, desc: Descriptors) -> StoreResult:
        """:meth:`kvmove.MooncakeStore.put` of ``desc``, whose keys must be among
        :attr:`keys` (else ``ValueError``, before anything is sent)."""
        desc = check_desc(desc)
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
            return self._put(desc, flags)

    def close(self) -> None:
        """Give the client back (idempotent), once the exists check has returned or timed
        out (bounded by ``call_timeout``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._answer()
            except StoreError as e:  # a broken answer no put asked for
                log.warning("exists check of a put begun and not made: %s", e)
            finally:
                self._release()

    def __enter__(self) -> PendingPut:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
