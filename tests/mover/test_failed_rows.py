"""The failed-rows contract of a prefetch (``docs/API.md``, "The HiSparse paths"), on a real
embedded master: a get that fails mid-object (Mooncake wrote part of the bytes and then
reported a failed transfer, as it can) ends ``FAILED`` for that key; the rows of the other
keys are exact and no byte outside the failed key's rows changes, on either path. In place
(the default wherever it measures faster) the failed key's rows may hold part of its bytes;
with ``keep_failed_rows=True`` (the prefetches staged) they are untouched too."""

from __future__ import annotations

import ctypes

import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.status import TRANSFER_FAIL
from tests.support.caches import GEOMETRIES, underlying
from tests.support.store_state import swap_client

PAGE_TOKENS = 4
SCRIBBLE = 0xEE


class HalfWrittenGets:
    """A Mooncake client that forwards every call; a get of a key in ``broken`` writes the
    object, then overwrites the second half of its spans and answers ``TRANSFER_FAIL``, and
    no other replica of it is listed (its only holder died mid-transfer)."""

    def __init__(self, real):
        self._real = real
        self.broken: set[str] = set()
        self.hit = 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        codes = list(self._real.batch_get_into_multi_buffers(keys, ptrs, sizes))
        for i, key in enumerate(keys):
            if key in self.broken:
                half = len(ptrs[i]) // 2
                for ptr, n in zip(ptrs[i][half:], sizes[i][half:], strict=True):
                    ctypes.memset(ptr, SCRIBBLE, n)
                codes[i] = TRANSFER_FAIL
                self.hit += 1
        return codes

    def batch_get_replica_desc(self, keys):
        listed = self._real.batch_get_replica_desc(keys)
        return {k: v for k, v in listed.items() if k not in self.broken}


def page_rows(kv: kvmove.KVCache, rows: torch.Tensor) -> list[torch.Tensor]:
    return [kv.layer(n, layer)[rows].clone() for n in kv.buffer_names
            for layer in range(kv.num_layers(n))]


def outside(kv: kvmove.KVCache, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every byte of the cache's memory (padding between rows included) with ``rows`` of
    every layer zeroed: what must not change. The cache is left as it was."""
    kept = page_rows(kv, rows)
    views = [kv.layer(n, layer) for n in kv.buffer_names for layer in range(kv.num_layers(n))]
    for view in views:
        view[rows] = 0
    out = underlying(kv)
    for view, saved in zip(views, kept, strict=True):
        view[rows] = saved
    return out


@pytest.mark.parametrize("geometry", ["mla", "hybrid"])
@pytest.mark.parametrize("how", [{"path": "in_place"}, {"path": "staged"},
                                 {"path": "auto", "keep_failed_rows": True}],
                         ids=["in_place", "staged", "auto+keep_failed_rows"])
def test_a_get_failed_mid_object_changes_nothing_outside_its_own_rows(store, keyspace,
                                                                      geometry, how):
    kv = kvmove.KVCache(GEOMETRIES[geometry](64))
    with kvmove.KVMover(kv, store, page_tokens=PAGE_TOKENS, staging_slots=4, **how) as m:
        if how.get("keep_failed_rows"):
            assert m.path_choice.prefetch == "staged"
        keys = keyspace(4, tag=f"{geometry}-{m.path}")
        src = torch.arange(16).reshape(4, PAGE_TOKENS)
        want = [page_rows(kv, page) for page in src]
        assert m.evict(keys, src).wait(30) == [Status.OK] * 4
        client = swap_client(store, HalfWrittenGets)
        client.broken = set(m.keyspace.store_keys([keys[2]]))
        # scattered destination pages, every other slot
        dst = torch.arange(20, 52, 2).reshape(4, PAGE_TOKENS)
        before = page_rows(kv, dst[2])
        untouched = outside(kv, dst.reshape(-1))
        assert m.prefetch(keys, dst).wait(30) == [Status.OK, Status.OK, Status.FAILED,
                                                  Status.OK]
        assert client.hit == 1
        for i in (0, 1, 3):  # the other keys' rows are exact
            assert all(torch.equal(a, b) for a, b in zip(page_rows(kv, dst[i]), want[i],
                                                         strict=True)), i
        after = outside(kv, dst.reshape(-1))
        assert all(torch.equal(a, b) for a, b in zip(after, untouched, strict=True))
        failed_rows = page_rows(kv, dst[2])
        kept = all(torch.equal(a, b) for a, b in zip(failed_rows, before, strict=True))
        if m.path_choice.prefetch == "staged":
            assert kept  # staged: no byte of a failed key reaches the KV rows
        else:
            assert not kept  # in place: part of the object (and the scribble) landed


def test_the_default_mover_prefetches_in_place_where_it_measures_faster(store, monkeypatch):
    from kvmove.mover import kv_mover as mover_module
    from kvmove.mover import path_choice

    path_choice.forget_recorded()
    measured = {"staged": {"evict": 2.0, "prefetch": 3.0},
                "in_place": {"evict": 1.0, "prefetch": 1.0}, "pages": 2, "rounds": 1}
    monkeypatch.setattr(mover_module, "probe", lambda *a, **k: measured)
    try:
        kv = kvmove.KVCache(GEOMETRIES["mla"](16))
        with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2) as m:
            assert (m.path_choice.evict, m.path_choice.prefetch) == ("in_place", "in_place")
    finally:
        path_choice.forget_recorded()
