"""The probe behind ``path="auto"`` for one-token pages: two small movers, one per path, on
a scratch cache of the mover's geometry, time evictions and prefetches through the mover's
own store, interleaved, best of a few calls (other work only ever adds time); first it
checks that failed in-place gets leave the rows untouched. ``docs/API.md``, "The in-place
path"."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import torch

from kvmove.memory.cache import KVCache
from kvmove.memory.host_memory import HostMemory
from kvmove.objects.descriptors import Descriptors
from kvmove.status import Status
from kvmove.store.protocol import Store

__all__ = ["DIRECTIONS", "failed_gets_write", "probe", "probe_pages", "scratch_cache"]

log = logging.getLogger(__name__)

DIRECTIONS = ("evict", "prefetch")
PROBE_PAGES = (4, 32)  # pages per probe call: the staging's slots, within these bounds
PROBE_ROUNDS = 3  # timed calls per path and direction (after one warm-up), interleaved
PROBE_BUDGET_S = 5.0  # a probe that has not finished its rounds by then decides on fewer

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


def probe(kv: KVCache, store: Store, *, page_tokens: int, layout: str,
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


def _forget(store: Store, keys: list[str]) -> None:
    """Remove the probe's objects (store keys); those never stored answer MISS."""
    if not keys:
        return
    try:
        store.remove(keys, force=True)
    except Exception as e:  # leftover probe objects cost space, not correctness
        log.debug("removing probe objects failed: %s", e)


def failed_gets_write(mover, store: Store, cache: KVCache, page: torch.Tensor) -> str | None:
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
