"""The hooks every level calls. With metrics off (the default) each is one global read and
a return; on, they add to the process's :class:`~kvmove.metrics.tallies.Tallies`."""

from __future__ import annotations

import time

from kvmove.metrics.tallies import Tallies

_tallies: Tallies | None = None  # set by kvmove.metrics.enable()
_now = time.perf_counter_ns


def clock() -> int:
    """``perf_counter_ns()`` where metrics are on, else 0: the start of a call's host time."""
    return _now() if _tallies is not None else 0


def call_done(op: str, started: int) -> None:
    """The host time of one ``op`` call (``evict``, ``prefetch``, ``send``) on the caller's
    thread, from ``started`` (:func:`clock`) to now."""
    if started:
        tallies = _tallies
        if tallies is not None:
            tallies.call_ns[op].observe(_now() - started)


def result(direction: str, result) -> None:
    """A finished piece of ``direction`` (``evict``, ``prefetch``, ``send``): a
    ``TransferResult`` (statuses, codes, bytes of its OK keys, stage times)."""
    tallies = _tallies
    if tallies is not None:
        tallies.add_result(direction, result)


def mover_built(staging, path_choice) -> None:
    """A mover was built: its staging (slots in use, read at scrape) and the path chosen."""
    tallies = _tallies
    if tallies is not None:
        tallies.add_mover(staging, path_choice.evict, path_choice.prefetch)


def failover(tried: int, recovered: int) -> None:
    """A replica failover: ``tried`` keys whose holder failed, ``recovered`` read from a
    live replica."""
    tallies = _tallies
    if tallies is not None:
        tallies.add_failover(tried, recovered)


def programs(cap: int) -> None:
    """A Triton copy launched with a config of at most ``cap`` programs (its grid is
    ``min(work items, cap)``; the kernel does not return it)."""
    tallies = _tallies
    if tallies is not None:
        tallies.programs.observe(cap)
