"""What both paths make of a store call's answer: statuses and codes per key, never an
exception that loses the other keys' results (``docs/API.md``, "Errors and statuses")."""

from __future__ import annotations

import logging

import numpy as np

from kvmove.mover.transfer import TransferResult
from kvmove.objects.descriptors import Descriptors
from kvmove.status import BAD_ROWS, CLIENT_EXCEPTION, MOVER_CLOSED, STAGING_TIMEOUT, Status

log = logging.getLogger(__name__)


def store_call(op, desc: Descriptors, **options
               ) -> tuple[list[Status], list[int], object, object]:
    """Run a store put/get (``options``: its keyword arguments); an exception becomes
    FAILED for every key. The third item is the future of store calls that timed out on
    this memory and are still in flight, or None; the fourth a put's ``late_stored`` (the
    keys those calls stored after all), or None."""
    if len(desc) == 0:
        return [], [], None, None
    try:
        statuses = op(desc, **options)
    except Exception as e:
        log.warning("%s of %d keys failed: %s", getattr(op, "__name__", "store call"),
                    len(desc), e)
        return [Status.FAILED] * len(desc), [-1] * len(desc), None, None
    codes = getattr(statuses, "codes", None)  # a default argument would be built always
    codes = (list(codes) if codes is not None
             else [0 if s is Status.OK else -1 for s in statuses])
    return (list(statuses), codes, getattr(statuses, "late", None),
            getattr(statuses, "late_stored", None))


def stored_keys(bad: np.ndarray | None, n: int) -> np.ndarray:
    """The positions of an evict's keys that are stored: those without an out-of-range row
    (``bad``: one flag per key, or None for none), the others logged."""
    good = np.arange(n) if bad is None else np.flatnonzero(~bad)
    if good.size < n:
        log.warning("evict: %d of %d keys have out-of-range rows; not stored",
                    n - good.size, n)
    return good


def fail_bad(bad: np.ndarray, statuses: list[Status], codes: list[int]) -> None:
    for i in np.flatnonzero(bad).tolist():
        statuses[i], codes[i] = Status.FAILED, BAD_ROWS
    if bad.any():
        log.warning("prefetch: %d keys have out-of-range rows; not scattered", int(bad.sum()))


def ok_bytes(desc: Descriptors, statuses: list[Status]) -> int:
    if statuses.count(Status.OK) == len(statuses):  # the common case: one pass, in C
        return desc.total_bytes
    return sum(desc.nbytes(i) for i, s in enumerate(statuses) if s is Status.OK)


def unstaged(n: int, timeout: float | None) -> TransferResult:
    log.warning("no staging slots came free within %s s: %d keys not moved", timeout, n)
    return TransferResult([Status.FAILED] * n, [STAGING_TIMEOUT] * n, 0)


def not_started(n: int, error: Exception, *, closed: bool) -> TransferResult:
    """The result of the last ``n`` keys of an evict whose earlier pieces are in flight
    when the next one could not start (the mover closed meanwhile, or an error)."""
    log.log(logging.WARNING if closed else logging.ERROR,
            "%d keys of an evict not moved: %s", n,
            "the KVMover was closed during the call" if closed else repr(error),
            exc_info=None if closed else error)
    code = MOVER_CLOSED if closed else CLIENT_EXCEPTION
    return TransferResult([Status.FAILED] * n, [code] * n, 0)
