"""What a store call answers: a :class:`StoreResult` of one :class:`kvmove.Status` per key,
and the tables from Mooncake's codes to those statuses. The contract: ``docs/API.md``, "The
store"."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

from kvmove.errors import StoreError
from kvmove.objects.descriptors import Descriptors
from kvmove.status import (
    CALL_TIMEOUT,
    CLIENT_EXCEPTION,
    INVALID_PARAMS,
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
from kvmove.store.bounded_call import CallOutcome, settled

log = logging.getLogger(__name__)

__all__ = ["StoreResult"]


class StoreResult(list):
    """One entry per key, in key order (``Status``, or ``bool`` for ``exists``). ``codes``:
    Mooncake's raw result of each key. ``late``: ``None``, or a future that completes once
    the Mooncake calls that timed out have really returned (until then they may still use
    the descriptors' memory). ``late_stored`` (put): ``None``, or a future of the keys those
    calls stored after all. See ``docs/API.md``, "The store"."""

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


# Mooncake's code -> the key's status; a code not in a table is FAILED.
PUT_STATUS: Mapping[int, Status] = {
    0: Status.OK,
    OBJECT_ALREADY_EXISTS: Status.EXISTS,  # also the store's own code for a key it found
    **{code: Status.NO_SPACE for code in NO_SPACE_CODES},
}
REMOVE_STATUS: Mapping[int, Status] = {0: Status.OK, OBJECT_NOT_FOUND: Status.MISS}
# A get's negative codes (a non-negative one is a size: OK when it is the described one,
# else SIZE_MISMATCH).
GET_STATUS: Mapping[int, Status] = {
    OBJECT_NOT_FOUND: Status.MISS,
    REPLICA_IS_NOT_READY: Status.MISS,  # a put of the key has started and not finished
}
# Get codes the master's ``get_size(key)`` tells apart (MISS: the key is gone; FAILED: the
# stored size is the described one; SIZE_MISMATCH: another size), and the status of each
# when that question goes unanswered.
ASK_SIZE: Mapping[int, Status] = {
    INVALID_PARAMS: Status.SIZE_MISMATCH,  # -600: the destination is smaller
    TRANSFER_FAIL: Status.FAILED,  # -800: a failed transfer, or a larger destination
}
# Codes of a master that could not be reached.
UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})


def put_statuses(codes: list[int]) -> list[Status]:
    if not any(codes):
        return [Status.OK] * len(codes)
    return [PUT_STATUS.get(c, Status.FAILED) for c in codes]


def remove_statuses(codes: list[int]) -> list[Status]:
    return [REMOVE_STATUS.get(c, Status.FAILED) for c in codes]


def get_status(code: int, size: int, stored: int) -> Status:
    """A key's status from its get ``code``, its described ``size`` and, for the codes of
    :data:`ASK_SIZE`, its ``stored`` size (``get_size``; negative: not known)."""
    if code == size:
        return Status.OK
    if code >= 0:
        return Status.SIZE_MISMATCH
    if code in ASK_SIZE:
        if stored == OBJECT_NOT_FOUND:
            return Status.MISS
        if stored >= 0:
            return Status.FAILED if stored == size else Status.SIZE_MISMATCH
        return ASK_SIZE[code]
    return GET_STATUS.get(code, Status.FAILED)


def unreachable(codes: list[int]) -> bool:
    """Whether every code of a call says the master could not be reached."""
    return bool(codes) and all(c in UNREACHABLE for c in codes)


def stops_the_call(codes: list[int]) -> bool:
    """Whether the rest of a put/get/exists/remove is not tried after this chunk: the
    master is unreachable, or a Mooncake call timed out."""
    return unreachable(codes) or CALL_TIMEOUT in codes


def check_desc(desc) -> Descriptors:
    if not isinstance(desc, Descriptors):
        raise TypeError(f"expected kvmove.Descriptors (from describe()), got {type(desc)}")
    return desc


class Codes(list):
    """A Mooncake call's per-key codes; ``late``: the future of the call, when it timed out;
    ``late_puts``: ``(keys, future)`` of each put call that timed out (the future holds its
    raw codes once it returns)."""

    __slots__ = ("late", "late_puts")

    def __init__(self, values, late=None, late_puts=()):
        super().__init__(values)
        self.late = late
        self.late_puts = list(late_puts)


def batch_codes(fn: Callable, keys: list[str], outcome: CallOutcome, data: bool) -> list[int]:
    """The per-key codes of a batch call's ``outcome``: ``CALL_TIMEOUT`` for every key when
    it timed out (with its future as ``late`` for a data call), ``CLIENT_EXCEPTION`` when it
    raised; ``StoreError`` when it answered for a different number of keys."""
    if not outcome.done:
        return Codes([CALL_TIMEOUT] * len(keys), outcome.late if data else None)
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


def stored_late(late_puts: list[tuple[list[str], Future]], after: Future | None = None
                ) -> Future | None:
    """A future of the keys the put calls that timed out stored after all (their code
    ``0``; every key of a call that raised: not known), once every one of them has returned
    (and ``after``, the put's ``late``: its memory is released then)."""
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


def log_outcome(op: str, keys: list[str], result: StoreResult) -> None:
    if Status.FAILED in result:
        failed = [i for i, s in enumerate(result) if s is Status.FAILED]
        names = Counter(code_name(result.codes[i]) for i in failed)
        log.warning("%s: %d of %d keys failed (%s); first %r", op, len(failed), len(keys),
                    ", ".join(f"{k} x{v}" for k, v in names.items()), keys[failed[0]])
    elif log.isEnabledFor(logging.DEBUG):
        log.debug("%s of %d keys: %s", op, len(keys), result.summary())
