"""GB/s is bytes over the time those bytes took: a store throttled to a known rate (each
put and get of the real embedded master padded to ``bytes / RATE`` seconds, 5 MB/s) shows
that rate, and the time the throttled calls really took."""

from __future__ import annotations

import time

import torch

import kvmove

RATE = 5e6  # bytes per second


class ThrottledStore:
    """The real store, each put and get lasting ``bytes described / RATE`` at least; the
    calls' own wall time is kept in ``spent``."""

    def __init__(self, store):
        self._store = store
        self.spent = {"put": 0.0, "get": 0.0}

    def __getattr__(self, name):
        return getattr(self._store, name)

    def begin_put(self, keys, **options):
        return None  # the mover then calls put() itself

    def _throttled(self, op: str, desc, **options):
        t0 = time.perf_counter()
        out = getattr(self._store, op)(desc, **options)
        rest = desc.total_bytes / RATE - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        self.spent[op] += time.perf_counter() - t0
        return out

    def put(self, desc, **options):
        return self._throttled("put", desc, **options)

    def get(self, desc, **options):
        return self._throttled("get", desc, **options)


def test_exported_rate_is_the_throttled_rate(registry, store, keyspace):
    throttled = ThrottledStore(store)
    layers, row, page_tokens, pages = 4, 656, 16, 8  # 336 KB a call: 67 ms at RATE
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (layers, 2 * pages * page_tokens, row),
                                             dtype=torch.uint8)})
    src = torch.arange(pages * page_tokens).reshape(pages, page_tokens)
    calls = 4
    with kvmove.KVMover(kv, throttled, page_tokens=page_tokens, staging_slots=pages,
                        path="staged") as mover:
        for i in range(calls):
            keys = keyspace(pages, tag=f"c{i}")
            assert mover.evict(keys, src).wait(30) == [kvmove.Status.OK] * pages
            assert mover.prefetch(keys, src + pages * page_tokens).wait(30) == [
                kvmove.Status.OK] * pages
    moved = calls * pages * page_tokens * row * layers
    for direction, stage in (("evict", "put"), ("prefetch", "get")):
        labels = {"direction": direction, "stage": stage}
        assert registry.get_sample_value("kvmove_bytes_total", labels) == moved
        rate = registry.get_sample_value("kvmove_throughput_bytes_per_second", labels)
        seconds = registry.get_sample_value("kvmove_stage_seconds_total", labels)
        # the time the throttled calls took (plus the mover's little around each; a loaded
        # 2-core machine may add milliseconds) ...
        assert throttled.spent[stage] <= seconds <= throttled.spent[stage] * 1.1 + 0.02, (
            stage, seconds, throttled.spent[stage])
        # ... and so the throttled rate, never faster
        assert 0.8 * RATE <= rate <= RATE * 1.001, (stage, rate)
        assert rate == moved / seconds
