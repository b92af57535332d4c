"""Which way a :class:`~kvmove.KVMover` moves pages, for evictions and for prefetches each:
``"staged"`` or ``"in_place"``, and how ``path="auto"`` decides (recorded per kind of
mover, or measured by :mod:`kvmove.mover.path_probe`). The rules are ``docs/API.md``, "The
in-place path"; the choice is logged here (``KVMover path: ...``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmove.memory.cache import KVCache
from kvmove.mover.path_probe import DIRECTIONS, probe
from kvmove.objects.in_place import rows_reachable
from kvmove.store.protocol import Store

__all__ = ["PATHS", "PathChoice", "check_keep_failed_rows", "check_path", "decide",
           "forget_recorded", "in_place_refusal", "keeping_failed_rows", "log_choice", "probe",
           "resolve"]

log = logging.getLogger(__name__)

PATHS = ("auto", "staged", "in_place")


@dataclass(frozen=True)
class PathChoice:
    """The path of evictions (``evict``) and of prefetches (``prefetch``), and why:
    ``reason`` is one line for the log; ``figures`` the probe's best times in ms per path
    and direction (empty when nothing was measured); ``recorded`` whether an earlier probe
    decided. ``path`` is the path of both directions, or ``"mixed"``."""

    evict: str
    prefetch: str
    reason: str
    figures: dict = field(default_factory=dict)
    recorded: bool = False

    @property
    def path(self) -> str:
        return self.evict if self.evict == self.prefetch else "mixed"

    @classmethod
    def both(cls, path: str, reason: str) -> PathChoice:
        return cls(path, path, reason)


_RECORDED: dict[tuple, PathChoice] = {}
_RECORD_LOCK = threading.Lock()


def check_path(path) -> str:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    return path


def in_place_refusal(kv: KVCache, store: Store, *, checksum: bool) -> str | None:
    """Why the KV rows of ``kv`` cannot be moved in place through ``store``, or ``None``."""
    if checksum:
        return ("checksum=True needs staging: the checksum is computed from the staged "
                "bytes and checked before the scatter")
    transport = store.transport
    if transport is None:
        return f"the store ({type(store).__name__}) names no transport to move KV rows in place"
    return rows_reachable(kv.device, transport)


def record_key(kv: KVCache, store: Store, page_tokens: int, layout: str) -> tuple:
    """What the choice depends on: the cache's geometry and memory kind, the page shape,
    the layout, the transport and the master."""
    geometry = tuple((n, b.num_layers, b.row_bytes, b.pitch)
                     for n, b in kv.row_pool.buffers.items())
    return (geometry, page_tokens, layout, kv.device.type, store.transport, store.address)


def resolve(path: str, kv: KVCache, store: Store, *, page_tokens: int, layout: str, checksum: bool,
            probe: Callable[[], dict], keep_failed_rows: bool = False,
            probe_failed: str = "staged") -> PathChoice:
    """The :class:`PathChoice` for ``path``: ``"staged"`` as asked; ``"in_place"`` as asked
    or ``ValueError`` saying why it cannot be; ``"auto"`` recorded, or measured with
    ``probe()`` (``{"staged": ms, "in_place": ms}``; it may raise: then ``probe_failed``,
    not recorded). ``keep_failed_rows`` stages the prefetches (see
    :func:`keeping_failed_rows`)."""
    check_keep_failed_rows(keep_failed_rows, path)
    choice = _resolve(path, kv, store, page_tokens=page_tokens, layout=layout,
                      checksum=checksum, probe=probe, probe_failed=_fallback(probe_failed))
    return keeping_failed_rows(choice) if keep_failed_rows else choice


def check_keep_failed_rows(keep_failed_rows, path: str) -> None:
    """``keep_failed_rows`` is a bool, and not asked of a mover told to prefetch in place."""
    if not isinstance(keep_failed_rows, bool):
        raise TypeError(f"keep_failed_rows must be a bool, got {keep_failed_rows!r}")
    if keep_failed_rows and path == "in_place":
        raise ValueError("keep_failed_rows=True cannot hold with path='in_place': a failed "
                         "in-place get may leave part of its object in the rows (use "
                         "path='auto' or 'staged')")


def _fallback(path: str) -> str:
    if path not in ("staged", "in_place"):
        raise ValueError(f"probe_failed must be 'staged' or 'in_place', got {path!r}")
    return path


def keeping_failed_rows(choice: PathChoice) -> PathChoice:
    """``choice`` with prefetches staged: a failed in-place get can leave part of its
    object in its key's rows, and ``keep_failed_rows=True`` promises them untouched."""
    if choice.prefetch != "in_place":
        return choice
    return PathChoice(choice.evict, "staged",
                      f"{choice.reason}; prefetches staged all the same: a failed in-place "
                      f"get may leave part of its object in the rows (keep_failed_rows=True)",
                      choice.figures, choice.recorded)


def _resolve(path: str, kv: KVCache, store: Store, *, page_tokens: int, layout: str,
             checksum: bool, probe: Callable[[], dict], probe_failed: str) -> PathChoice:
    check_path(path)
    refusal = None if path == "staged" else in_place_refusal(kv, store, checksum=checksum)
    if path == "staged":
        return PathChoice.both("staged", "asked for")
    if path == "in_place":
        if refusal is not None:
            raise ValueError(f"path='in_place' is not possible here: {refusal}")
        return PathChoice.both("in_place", "asked for")
    if refusal is not None:
        return PathChoice.both("staged", f"auto: in place is not possible ({refusal})")
    if page_tokens > 1:
        # Measured, not probed: with scattered tokens (HiSparse) a page in place is one span
        # per token row, slower than the gather (48 pages of 16 scattered 656-byte tokens x
        # 61 layers: put in place 1.13x the in-place floor, staged 0.76x), and over TCP into
        # another process's segment many-span objects stall Mooncake 0.3.13 for its 60 s
        # transfer timeout (32 keys of 128 spans).
        return PathChoice.both("staged", f"auto: pages of {page_tokens} tokens (in place, "
                                         f"scattered tokens are one span per row: slower, "
                                         f"and many-span objects stall Mooncake over TCP)")
    key = record_key(kv, store, page_tokens, layout)
    with _RECORD_LOCK:
        recorded = _RECORDED.get(key)
        if recorded is not None:
            return PathChoice(recorded.evict, recorded.prefetch, recorded.reason,
                              recorded.figures, recorded=True)
        try:
            figures = probe()
        except Exception as e:  # a store that fails under the probe: the caller's safe path
            log.warning("path probe failed (%s: %s); moving %s", type(e).__name__, e,
                        probe_failed.replace("_", " "))
            return PathChoice.both(probe_failed,
                                   f"auto: the probe failed ({type(e).__name__}: {e})")
        choice = decide(figures)
        _RECORDED[key] = choice
        return choice


def decide(figures: dict) -> PathChoice:
    """Per direction, the faster path by the probe's best times (``figures[path][direction]``,
    ms per call); staged when the probe found that a failed in-place get writes into the
    rows (``figures["unsafe"]``)."""
    if figures.get("unsafe"):
        return PathChoice("staged", "staged", f"auto: {figures['unsafe']}", figures)
    staged, in_place = figures["staged"], figures["in_place"]
    picked = {d: "in_place" if in_place[d] < staged[d] else "staged" for d in DIRECTIONS}
    said = "; ".join(f"{d} {picked[d]} (in place {in_place[d]:.2f} ms, staged "
                     f"{staged[d]:.2f} ms)" for d in DIRECTIONS)
    return PathChoice(picked["evict"], picked["prefetch"],
                      f"auto: {said}, {figures['pages']} pages, best of "
                      f"{figures['rounds']}", figures)


def forget_recorded() -> None:
    """Drop every recorded choice (the next ``auto`` mover probes again)."""
    with _RECORD_LOCK:
        _RECORDED.clear()


def log_choice(choice: PathChoice) -> None:
    """One log line: INFO for what ``auto`` picked, DEBUG for a path asked for."""
    level = logging.INFO if choice.reason.startswith("auto") else logging.DEBUG
    log.log(level, "KVMover path: evict %s, prefetch %s (%s%s)", choice.evict,
            choice.prefetch, choice.reason, ", recorded" if choice.recorded else "")
