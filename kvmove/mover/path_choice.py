"""Which way a :class:`~kvmove.KVMover` moves pages: ``"staged"`` (gather into staging, the
store reads the staging; get into staging, scatter) or ``"in_place"`` (the store reads and
writes the KV rows where they are, :mod:`kvmove.objects.in_place`), and how ``path="auto"``
chooses, for evictions and for prefetches each.

``auto`` measures where the answer is open. For one-token pages (a vLLM block, a token of
HiSparse's host pool) a page is one span per layer either way, and in place saves the copy.
When such a mover is built, a short probe builds two small movers, one per path, on a
scratch cache of the same geometry (buffers, layers, row bytes, row pitch, the same kind of
memory), and times evictions and prefetches of a batch of pages (as many as the staging
holds, 4 to 32) through the mover's own store, interleaved, and takes the best of a few
calls (other work on the machine only ever adds time, so the best is the steadiest estimate
of a path's own cost). The faster path wins, per direction. The choice is recorded for the
rest of the process by geometry, page size, layout, memory kind and the store's transport
and master: a later mover of the same kind takes it without probing, so ``auto`` is
deterministic once chosen.

Pages of several tokens stay staged under ``auto``, by a choice recorded from measurement
rather than probed: where the engine's tokens are scattered (HiSparse), a page in place is
one span per token row, ``page_tokens`` times the spans of its staged object, and that is
slower than the gather (``bench/bench_in_place.py``: 48 pages of 16 scattered 656-byte
tokens x 61 layers, put in place 1.13x the in-place floor, staged 0.76x) and, over TCP into
another process's segment, many-span objects stall Mooncake 0.3.13 for its 60 s transfer
timeout (seen: a two-process cluster, 32 keys of 128 spans). An engine whose pages are
runs of consecutive slots (one span per layer in place too) passes ``path="in_place"``.

In place is not offered, and ``auto`` picks ``staged`` without probing, where it cannot
hold: a KV cache in device memory over a transport that does not read it (TCP), objects
with a checksum (computed from the staged bytes), a store whose transport is unknown.

What a failed prefetch leaves behind differs, and ``auto`` respects it. Mooncake (0.3.13,
measured against a real master) checks a MISS and an object of another size before it
submits any transfer, and a holder that is already gone refuses the connection: in those
cases nothing is written, on either path. A transfer that breaks after its bytes began to
flow (the holder dies mid-transfer) has written part of the object into its destination:
on the staged path that is staging, on the in-place path it is the key's own KV rows (and
no other row). So on the in-place path a ``FAILED`` key's rows may hold part of its object.
``auto`` checks on the store at hand, before it considers in place, that a get of a missing
key and of a key of the wrong size (larger and smaller) leave the destination untouched; if
not, it stays staged.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvmove.memory.cache import KVCache
from kvmove.memory.host_memory import HostMemory
from kvmove.objects.descriptors import Descriptors
from kvmove.objects.in_place import rows_reachable
from kvmove.status import Status

__all__ = ["PATHS", "PathChoice", "check_path", "decide", "forget_recorded",
           "in_place_refusal", "log_choice", "probe", "resolve", "scratch_cache"]

log = logging.getLogger(__name__)

PATHS = ("auto", "staged", "in_place")
DIRECTIONS = ("evict", "prefetch")
PROBE_PAGES = (4, 32)  # pages per probe call: the staging's slots, within these bounds
PROBE_ROUNDS = 3  # timed calls per path and direction (after one warm-up), interleaved
PROBE_BUDGET_S = 5.0  # a probe that has not finished its rounds by then decides on fewer


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


def in_place_refusal(kv: KVCache, store, *, checksum: bool) -> str | None:
    """Why the KV rows of ``kv`` cannot be moved in place through ``store``, or ``None``."""
    if checksum:
        return ("checksum=True needs staging: the checksum is computed from the staged "
                "bytes and checked before the scatter")
    config = getattr(store, "config", None)
    protocol = getattr(config, "protocol", None)
    if protocol is None or not hasattr(store, "register"):
        return f"the store ({type(store).__name__}) names no transport to move KV rows in place"
    return rows_reachable(kv.device, protocol)


def record_key(kv: KVCache, store, page_tokens: int, layout: str) -> tuple:
    """What the choice depends on: the cache's geometry and memory kind, the page shape,
    the layout, the transport and the master."""
    geometry = tuple((n, b.num_layers, b.row_bytes, b.pitch)
                     for n, b in kv.row_pool.buffers.items())
    config = store.config
    return (geometry, page_tokens, layout, kv.device.type, config.protocol,
            getattr(store, "address", None))


def resolve(path: str, kv: KVCache, store, *, page_tokens: int, layout: str, checksum: bool,
            probe: Callable[[], dict], prefetch_into_free_rows: bool = False,
            probe_failed: str = "staged") -> PathChoice:
    """The :class:`PathChoice` for ``path``: ``"staged"`` as asked; ``"in_place"`` as asked
    or ``ValueError`` saying why it cannot be; ``"auto"`` recorded, or measured with
    ``probe()`` (``{"staged": ms, "in_place": ms}``; it may raise: then ``probe_failed``,
    not recorded). Under ``auto`` prefetches go in place only with
    ``prefetch_into_free_rows`` (see :func:`keep_failed_rows`)."""
    return keep_failed_rows(_resolve(path, kv, store, page_tokens=page_tokens, layout=layout,
                                     checksum=checksum, probe=probe,
                                     probe_failed=_fallback(probe_failed)),
                            asked=path, free_rows=prefetch_into_free_rows)


def _fallback(path: str) -> str:
    if path not in ("staged", "in_place"):
        raise ValueError(f"probe_failed must be 'staged' or 'in_place', got {path!r}")
    return path


def keep_failed_rows(choice: PathChoice, *, asked: str, free_rows: bool) -> PathChoice:
    """``choice`` with prefetches staged where ``auto`` chose them in place but the caller
    did not say that a prefetch's rows hold nothing it needs until the prefetch is OK: a
    failed in-place get can leave part of its object in its key's rows, and the default
    contract is that a failed prefetch leaves the rows untouched."""
    if asked != "auto" or free_rows or choice.prefetch != "in_place":
        return choice
    return PathChoice(choice.evict, "staged",
                      f"{choice.reason}; prefetches staged all the same: a failed in-place "
                      f"get may leave part of its object in the rows "
                      f"(prefetch_into_free_rows=True allows it)",
                      choice.figures, choice.recorded)


def _resolve(path: str, kv: KVCache, store, *, page_tokens: int, layout: str,
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


# -- the probe ------------------------------------------------------------------------------


def scratch_cache(kv: KVCache, num_slots: int) -> KVCache:
    """A cache of ``kv``'s geometry (buffers, layers, row bytes, row pitch, device) with
    ``num_slots`` slots of random bytes, one stacked tensor per buffer."""
    g = torch.Generator().manual_seed(0)
    buffers = {}
    for name, b in kv.row_pool.buffers.items():
        raw = torch.randint(0, 256, (b.num_layers, num_slots, b.pitch), dtype=torch.uint8,
                            generator=g)
        buffers[name] = raw.to(kv.device)[:, :, : b.row_bytes]
    return KVCache(buffers)


def probe_pages(page_tokens: int, pages: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(source pages, destination pages, slots needed): token ``t`` of page ``i`` in slot
    ``2 * (i * page_tokens + t)`` (sources) or the slot after it (destinations): no two
    tokens of a page, and no two pages, in consecutive slots."""
    rows = 2 * torch.arange(pages * page_tokens, dtype=torch.int64).reshape(pages, page_tokens)
    return rows, rows + 1, 2 * pages * page_tokens


def probe(kv: KVCache, store, *, page_tokens: int, layout: str,
          make_mover: Callable[[KVCache, str, int], object], pages: int,
          rounds: int = PROBE_ROUNDS) -> dict:
    """Time evictions and prefetches of ``pages`` pages (bounded by ``PROBE_PAGES``) with a
    staged and an in-place mover (``make_mover(cache, path, staging_slots)``) on a scratch
    cache of ``kv``'s geometry, interleaved; first check that failed in-place gets leave the
    rows untouched. Returns ``{"staged": {"evict": ms, "prefetch": ms}, "in_place": {...},
    "pages": n, "rounds": r}`` (the best of ``rounds`` calls), or ``{"unsafe": why}``.
    Raises where a call does not end OK."""
    pages = min(max(pages, PROBE_PAGES[0]), PROBE_PAGES[1])
    src, dst, slots = probe_pages(page_tokens, pages)
    cache = scratch_cache(kv, slots)
    movers, stored = {}, []
    try:
        for path in ("staged", "in_place"):
            movers[path] = make_mover(cache, path, pages)
        unsafe = failed_gets_write(movers["in_place"], store, cache, dst[0])
        if unsafe:
            return {"unsafe": unsafe}
        tag = uuid.uuid4().hex[:12]
        samples = {p: {d: [] for d in DIRECTIONS} for p in movers}
        deadline = time.monotonic() + PROBE_BUDGET_S
        for r in range(rounds + 1):
            order = list(movers) if r % 2 == 0 else list(movers)[::-1]
            keys = {p: [f"kvmove-probe-{tag}-{r}-{p}-{i}" for i in range(pages)]
                    for p in movers}
            stored = [k for p, m in movers.items() for k in m.keyspace.store_keys(keys[p])]
            for direction in DIRECTIONS:
                for path in order:
                    seconds = _timed(movers[path], direction, keys[path], src, dst)
                    if r > 0:  # the first round warms up
                        samples[path][direction].append(seconds)
            _forget(store, stored)
            stored = []
            if time.monotonic() > deadline and r >= 1:
                break
    finally:
        _forget(store, stored)
        for m in movers.values():
            m.close()
    best = {p: {d: min(v) * 1e3 for d, v in by.items()} for p, by in samples.items()}
    return {**best, "pages": pages, "rounds": len(samples["staged"]["evict"])}


def _timed(mover, direction: str, keys: list[str], src: torch.Tensor,
           dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    if direction == "evict":
        statuses = mover.evict(keys, src).wait(30)
    else:
        statuses = mover.prefetch(keys, dst).wait(30)
    seconds = time.perf_counter() - t0
    if any(s is not Status.OK for s in statuses):
        raise RuntimeError(f"probe {direction} did not end OK: {_summary(statuses)}")
    return seconds


def _summary(statuses) -> str:
    return ", ".join(sorted({s.value for s in statuses}))


def _forget(store, keys: list[str]) -> None:
    """Remove the probe's objects (store keys); those never stored answer MISS."""
    if not keys:
        return
    try:
        store.remove(keys, force=True)
    except Exception as e:  # leftover probe objects cost space, not correctness
        log.debug("removing probe objects failed: %s", e)


def failed_gets_write(mover, store, cache: KVCache, page: torch.Tensor) -> str | None:
    """Whether a get that fails before its transfer writes into the KV rows on this store,
    through the in-place ``mover``: a missing key, and objects one byte larger and one
    byte smaller than the page must end MISS / SIZE_MISMATCH with the page's rows
    untouched. A sentence saying what went wrong, or ``None``."""
    tag = uuid.uuid4().hex[:12]
    object_bytes = mover.staging.object_bytes
    wrong = {f"kvmove-probe-{tag}-larger": object_bytes + 1,
             f"kvmove-probe-{tag}-smaller": object_bytes - 1}
    wrong = {k: n for k, n in wrong.items() if n > 0}
    stored = [mover.keyspace.store_keys([k])[0] for k in wrong]
    source = HostMemory(object_bytes + 1, pin=None)
    try:
        source.tensor.fill_(0xA5)
        desc = Descriptors(stored, [[source.address]] * len(stored),
                           [[n] for n in wrong.values()],
                           regions=[(source.address, source.nbytes)])
        if not all(s is Status.OK for s in store.put(desc)):
            raise RuntimeError("could not store the probe's wrong-size objects")
        keys = [f"kvmove-probe-{tag}-missing", *wrong]
        rows = page.repeat(len(keys), 1)  # every get aims at the same rows
        before = _rows_of(cache, page)
        want = [Status.MISS, *([Status.SIZE_MISMATCH] * len(wrong))]
        for key, expected in zip(keys, want, strict=True):
            got = mover.prefetch([key], rows[:1]).wait(30)
            if got != [expected]:
                return (f"a get of a {key.rsplit('-', 1)[1]} object ended {got[0].value}, "
                        f"not {expected.value}")
            if not all(torch.equal(a, b) for a, b in zip(before, _rows_of(cache, page),
                                                          strict=True)):
                return (f"a get of a {key.rsplit('-', 1)[1]} object wrote into the KV rows "
                        f"on this store: a failed in-place prefetch would not leave them "
                        f"untouched")
        return None
    finally:
        _forget(store, stored)
        store.unregister([(source.address, source.nbytes)])
        source.close()


def _rows_of(cache: KVCache, page: torch.Tensor) -> list[torch.Tensor]:
    rows = page[page >= 0].to(cache.device)
    return [cache.layer(n, layer)[rows].clone() for n in cache.buffer_names
            for layer in range(cache.num_layers(n))]


def log_choice(choice: PathChoice) -> None:
    """One log line: INFO for what ``auto`` picked, DEBUG for a path asked for."""
    level = logging.INFO if choice.reason.startswith("auto") else logging.DEBUG
    log.log(level, "KVMover path: evict %s, prefetch %s (%s%s)", choice.evict,
            choice.prefetch, choice.reason, ", recorded" if choice.recorded else "")
