"""How ``KVMover(path=...)`` chooses (:mod:`kvmove.mover.path_choice`) and what the probe
behind ``auto`` measures (:mod:`kvmove.mover.path_probe`), on a real embedded master:
in place refused where it cannot hold, ``auto`` deterministic once chosen, decided per
direction, staged where the probe fails or a failed get would write into the rows, and
prefetches staged unless their rows are free."""

from __future__ import annotations

import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.mover import kv_mover as mover_module
from kvmove.mover import path_choice, path_probe
from tests.mover.test_in_place_path import rows_bytes, scribble
from tests.support.caches import GEOMETRIES
from tests.support.memory_store import MemoryStore


def test_failed_gets_in_place_leave_the_rows_untouched(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place") as m:
        keys = keyspace(3)
        assert m.evict(keys[:2], torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),
                       valid_tokens=[4, 2]).wait(30) == [Status.OK] * 2
        dest = torch.tensor([[16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, 27]])
        scribble(kv, dest.reshape(-1))
        before = rows_bytes(kv, dest.reshape(-1))
        # a whole page read as a short one (object larger than the rows), a short page read
        # as a whole one (smaller), a key never stored
        got = m.prefetch(keys, dest, valid_tokens=[2, 4, 4]).result(30)
        assert got.statuses == [Status.SIZE_MISMATCH, Status.SIZE_MISMATCH, Status.MISS]
        assert got.codes == [-600, -800, -704]
        assert rows_bytes(kv, dest.reshape(-1)) == before
        assert path_probe.failed_gets_write(m, store, kv, dest[0]) is None


def test_in_place_refuses_what_it_cannot_hold(store):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    with pytest.raises(ValueError, match="checksum"):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=2, checksum=True,
                       path="in_place")
    with pytest.raises(ValueError, match="path"):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=2, path="zero_copy")
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=2, checksum=True) as m:
        assert m.path == "staged" and "checksum" in m.path_choice.reason
    why = path_choice.in_place_refusal(kv, MemoryStore(), checksum=False)  # transport None
    assert "names no transport" in why


def test_auto_is_deterministic_once_chosen(store, keyspace, monkeypatch):
    path_choice.forget_recorded()
    probes = []
    real = mover_module.probe
    monkeypatch.setattr(mover_module, "probe", lambda *a, **k: probes.append(k) or real(*a, **k))
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](64))
    first = kvmove.KVMover(kv, store, page_tokens=1, staging_slots=4)
    second = kvmove.KVMover(kvmove.KVCache(GEOMETRIES["hybrid"](64)), store, page_tokens=1,
                            staging_slots=16)
    other = kvmove.KVMover(kvmove.KVCache(GEOMETRIES["mla"](64)), store, page_tokens=1,
                           staging_slots=4)
    several = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4)
    try:
        assert len(probes) == 2  # the second mover of a kind takes the recorded choice
        a, b = first.path_choice, second.path_choice
        assert (a.evict, a.prefetch, a.reason) == (b.evict, b.prefetch, b.reason)
        assert b.recorded and not a.recorded and not other.path_choice.recorded
        assert several.path == "staged" and "pages of 4 tokens" in several.path_choice.reason
        for d in ("evict", "prefetch"):
            assert a.figures["staged"][d] > 0 and a.figures["in_place"][d] > 0
        assert a.path in ("staged", "in_place", "mixed")
        # Whatever it picked, the objects are the staged ones and read back.
        keys = keyspace(8)
        want = rows_bytes(kv, torch.arange(8))
        assert first.evict(keys, torch.arange(8).reshape(8, 1)).wait(30) == [Status.OK] * 8
        assert second.prefetch(keys, torch.arange(32, 40).reshape(8, 1)).wait(30) == [
            Status.OK] * 8
        assert rows_bytes(second.kv, torch.arange(32, 40)) == want
    finally:
        for m in (first, second, other, several):
            m.close()


def test_auto_decides_each_direction_by_the_probe():
    figures = {"staged": {"evict": 2.0, "prefetch": 3.0},
               "in_place": {"evict": 2.5, "prefetch": 1.0}, "pages": 8, "rounds": 3}
    choice = path_choice.decide(figures)
    assert (choice.evict, choice.prefetch, choice.path) == ("staged", "in_place", "mixed")
    assert "evict staged" in choice.reason and "prefetch in_place" in choice.reason
    unsafe = path_choice.decide({"unsafe": "a get of a smaller object wrote into the rows"})
    assert (unsafe.evict, unsafe.prefetch) == ("staged", "staged")
    assert "wrote" in unsafe.reason


def test_a_probe_that_fails_leaves_auto_staged(store, monkeypatch):
    path_choice.forget_recorded()

    def broken(*args, **kwargs):
        raise RuntimeError("probe evict did not end OK: no_space")

    monkeypatch.setattr(mover_module, "probe", broken)
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2) as m:
        assert m.path == "staged" and "probe failed" in m.path_choice.reason
    path_choice.forget_recorded()


def test_a_caller_names_the_path_a_failed_probe_leaves(store):
    path_choice.forget_recorded()
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))

    def broken():
        raise RuntimeError("no room for scratch pages")

    for fallback in ("in_place", "staged"):
        choice = path_choice.resolve("auto", kv, store, page_tokens=1, layout="layer_first",
                                     checksum=False, probe=broken,
                                     probe_failed=fallback)
        assert (choice.evict, choice.prefetch) == (fallback, fallback)
        assert "probe failed" in choice.reason and not choice.recorded
    with pytest.raises(ValueError, match="probe_failed"):
        path_choice.resolve("auto", kv, store, page_tokens=1, layout="layer_first",
                            checksum=False, probe=broken, probe_failed="auto")
    path_choice.forget_recorded()


def test_keeping_failed_rows_stages_the_prefetches_only():
    # A failed in-place get can leave part of its object in the key's rows: a caller that
    # asks for those rows untouched (keep_failed_rows=True) gets its prefetches staged.
    chose_both = path_choice.PathChoice("in_place", "in_place", "auto: measured")
    kept = path_choice.keeping_failed_rows(chose_both)
    assert (kept.evict, kept.prefetch) == ("in_place", "staged")
    assert "keep_failed_rows=True" in kept.reason
    staged = path_choice.PathChoice("in_place", "staged", "auto: measured")
    assert path_choice.keeping_failed_rows(staged) is staged


def test_keep_failed_rows_is_checked_before_anything(store):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    with pytest.raises(TypeError, match="keep_failed_rows must be a bool, got 'yes'"):
        kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2, keep_failed_rows="yes")
    with pytest.raises(ValueError, match="keep_failed_rows=True cannot hold with "
                                         "path='in_place'"):
        kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2, path="in_place",
                       keep_failed_rows=True)
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2, path="staged",
                        keep_failed_rows=True) as m:
        assert m.path == "staged"


def test_the_mover_passes_its_promise_about_prefetch_rows(store, monkeypatch):
    path_choice.forget_recorded()
    measured = {"staged": {"evict": 2.0, "prefetch": 3.0},
                "in_place": {"evict": 1.0, "prefetch": 1.0}, "pages": 2, "rounds": 1}
    monkeypatch.setattr(mover_module, "probe", lambda *a, **k: measured)
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    try:
        with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2) as m:
            assert m.path == "in_place"  # by default, where it measures faster
        with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=2,
                            keep_failed_rows=True) as m:
            assert (m.path_choice.evict, m.path_choice.prefetch) == ("in_place", "staged")
            assert "keep_failed_rows=True" in m.path_choice.reason
    finally:
        path_choice.forget_recorded()
