"""Soak: random evict/prefetch cycles for a bounded time (``KVMOVE_SOAK_SECONDS``, default
45; longer runs set it) over a hybrid KV cache, against a real embedded mooncake_master,
with every byte verified, resident memory checked for growth, and the staging pool full at
the end.

Each cycle issues an evict of new keys and a prefetch of stored keys (plus, now and then, a
key that is not stored, or one with the wrong ``valid_tokens``) together, so both are in
flight at once, then checks each key's status against a model of the store and every byte
of the rows: a prefetched page equals the bytes evicted under its key, the rows of any other
key are untouched. Some cycles evict a stored key again (``EXISTS``, the first object
kept) or remove keys. Pages are full or partial (``valid_tokens``, ``-1`` padding), scattered
at once or layer by layer. The counts are printed at the end.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections import Counter

import pytest
import torch

import kvmove
from kvmove import Status
from tests.support.caches import make_layers, write_random
from tests.support.process_table import rss_bytes

pytestmark = [pytest.mark.soak, pytest.mark.store]

SECONDS = float(os.environ.get("KVMOVE_SOAK_SECONDS", "45"))
RSS_GROWTH_BOUND = 64 << 20  # bytes of resident memory growth allowed after warm-up
PAGE = 16
SLOTS = 4096  # KV token slots: evicts read the first half, prefetches write the second
LIVE_CAP = 128  # stored keys kept at most (~6 MiB of objects in a 16 MiB segment)
STAGING = 32


def read_rows(kv: kvmove.KVCache, rows: torch.Tensor) -> torch.Tensor:
    """The bytes of ``rows`` in every buffer and layer, concatenated (uint8)."""
    return torch.cat([kv.layer(n, layer)[rows].reshape(len(rows), -1).view(torch.uint8)
                      .reshape(-1) for n in kv.buffer_names
                      for layer in range(kv.num_layers(n))])


def token_pages(slots: torch.Tensor, valid: list[int]) -> torch.Tensor:
    """``[n, PAGE]`` token pages from distinct ``slots``; rows past ``valid[i]`` are ``-1``."""
    pages = slots[: len(valid) * PAGE].reshape(len(valid), PAGE).clone()
    for i, v in enumerate(valid):
        pages[i, v:] = -1
    return pages


def test_soak_random_evict_prefetch_cycles(capsys):
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(1234)
    kv = kvmove.KVCache({"kv": make_layers(4, SLOTS, 656, torch.uint8, seed=41),
                         "indexer": make_layers(2, SLOTS, 132, torch.float32, pitch_pad=1,
                                                seed=42)})
    store = kvmove.MooncakeStore.embedded(global_segment_size="16mb")
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=STAGING,
                           key_prefix="soak")
    stored: dict[str, tuple[int, torch.Tensor]] = {}  # key -> (valid_tokens, bytes)
    gone: list[str] = []  # keys removed from the store
    n = Counter()
    serial = 0
    deadline = time.monotonic() + SECONDS
    warm_until = time.monotonic() + min(10.0, SECONDS / 5)
    rss_warm = None
    half = torch.arange(SLOTS // 2)
    try:
        while time.monotonic() < deadline:
            if rss_warm is None and time.monotonic() >= warm_until:
                gc.collect()
                rss_warm = rss_bytes()
            n["cycles"] += 1
            # -- an evict of new keys (or, now and then, of a stored key: EXISTS)
            k = rng.randint(1, 8)
            valid = [PAGE if rng.random() < 0.7 else rng.randint(1, PAGE) for _ in range(k)]
            new_keys = [f"p{serial + i}" for i in range(k)]
            serial += k
            again = None
            if stored and rng.random() < 0.05:
                again = rng.choice(sorted(stored))
                new_keys[0], valid[0] = again, stored[again][0]
            src = token_pages(half[torch.randperm(SLOTS // 2, generator=gen)], valid)
            write_random(kv, src[src >= 0], gen)
            want_put = [read_rows(kv, p[p >= 0]) for p in src]
            evict = mover.evict(new_keys, src, valid_tokens=valid)
            # -- a prefetch of stored keys, at the same time
            chosen = rng.sample(sorted(k_ for k_ in stored if k_ != again),
                                min(len(stored) - (again is not None), rng.randint(1, 8)))
            expect = [Status.OK] * len(chosen)
            pvalid = [stored[k_][0] for k_ in chosen]
            if gone and rng.random() < 0.2:  # a removed key: MISS
                chosen.append(rng.choice(gone))
                expect.append(Status.MISS)
                pvalid.append(PAGE)
            if chosen and rng.random() < 0.03:  # another size than stored: SIZE_MISMATCH
                i = rng.randrange(len(chosen))
                if expect[i] is Status.OK:
                    pvalid[i] = pvalid[i] % PAGE + 1
                    expect[i] = Status.SIZE_MISMATCH
            layerwise = rng.random() < 0.3
            prefetch = None
            if chosen:
                dst = token_pages(half[torch.randperm(SLOTS // 2, generator=gen)] + SLOTS // 2,
                                  pvalid)
                write_random(kv, dst[dst >= 0], gen)
                before = [read_rows(kv, p[p >= 0]) for p in dst]
                prefetch = mover.prefetch(chosen, dst, layerwise=layerwise,
                                          valid_tokens=pvalid)
            # -- check the evict
            statuses = evict.wait(60)
            want_status = [Status.OK] * k
            if again is not None:
                want_status[0] = Status.EXISTS
            assert statuses == want_status, (new_keys, statuses)
            for key, v, data, st in zip(new_keys, valid, want_put, statuses, strict=True):
                if st is Status.OK:
                    stored[key] = (v, data)
                    n["pages put"] += 1
                    n["partial pages put"] += v < PAGE
                else:
                    n["evicts of a stored key (EXISTS)"] += 1
            n["evicts"] += 1
            # -- check the prefetch, byte for byte
            if prefetch is not None:
                statuses = prefetch.wait(60)
                assert statuses == expect, (chosen, statuses, expect)
                for key, st, p, old in zip(chosen, statuses, dst, before, strict=True):
                    got = read_rows(kv, p[p >= 0])
                    if st is Status.OK:
                        assert torch.equal(got, stored[key][1]), f"wrong bytes for {key}"
                        n["pages got"] += 1
                    else:
                        assert torch.equal(got, old), f"{st.value} of {key} wrote rows"
                        n[f"prefetch {st.value}"] += 1
                    n["bytes verified"] += got.numel()
                n["prefetches"] += 1
                n["layerwise prefetches"] += layerwise
            # -- now and then, or when the store holds enough, remove some keys
            if len(stored) > LIVE_CAP or rng.random() < 0.05:
                victims = rng.sample(sorted(stored), min(len(stored), rng.randint(1, 16)))
                removed = store.remove(mover.keyspace.store_keys(victims), force=True)
                assert removed == [Status.OK] * len(victims), removed
                for key in victims:
                    del stored[key]
                gone = (gone + victims)[-256:]
                n["pages removed"] += len(victims)
        assert mover.staging.num_free == mover.staging.num_slots  # every slot back in the pool
        stats = mover.stats()
        assert stats.pages_put == n["pages put"] and stats.pages_got == n["pages got"]
        gc.collect()
        rss_end = rss_bytes()
    finally:
        mover.close()
        store.close()
    assert rss_warm is not None, "the soak ended before its warm-up"
    growth = rss_end - rss_warm
    report = (
        f"\n[soak] {SECONDS:g}s: {n['cycles']} cycles, {n['evicts']} evicts, "
        f"{n['prefetches']} prefetches ({n['layerwise prefetches']} layer-wise); "
        f"{n['pages put']} pages put ({n['partial pages put']} partial), "
        f"{n['pages got']} pages got, {n['prefetch miss']} MISS, "
        f"{n['prefetch size_mismatch']} SIZE_MISMATCH, "
        f"{n['evicts of a stored key (EXISTS)']} EXISTS, {n['pages removed']} removed; "
        f"{n['bytes verified'] / 2**30:.2f} GiB verified byte for byte; RSS "
        f"{rss_warm / 2**20:.1f} MiB after warm-up -> {rss_end / 2**20:.1f} MiB at the end "
        f"({growth / 2**20:+.1f} MiB, bound {RSS_GROWTH_BOUND >> 20} MiB)"
    )
    with capsys.disabled():
        print(report)
    assert n["cycles"] >= 10 * SECONDS, "too few cycles to call this a soak"
    assert growth < RSS_GROWTH_BOUND, report
