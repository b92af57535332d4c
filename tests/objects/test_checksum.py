"""End-to-end object checksums: computed while staging, stored with the object, verified
before any scatter. A corrupted stored object is a per-key failure and no corrupt byte
reaches the KV cache."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.objects.checksum import TRAILER_BYTES, PageChecksum
from kvmove.status import CHECKSUM_MISMATCH
from tests.support.caches import ROW_BYTES, make_layers, snapshot
from tests.support.staging_data import canonical

_MIX = 0x9E3779B97F4A7C15
PINNED = [-8116590607862969341, -5178427527267622496]  # test_fingerprint_is_pinned


def hybrid(slots):
    return kvmove.KVCache({"kv": make_layers(3, slots, 656, torch.uint8, seed=1),
                           "indexer": make_layers(2, slots, 132, torch.float32, seed=2)})


def test_checksum_changes_with_any_byte_and_with_swapped_layers():
    kv = hybrid(8)
    staging = kvmove.StagingBuffer(kv, num_slots=3, page_tokens=2, trailer_bytes=8)
    kvmove.gather(kv, staging, torch.tensor([[0, 1], [2, 3], [0, 1]]), torch.tensor([0, 1, 2]))
    ck = PageChecksum(staging)
    full = torch.full((3,), 2)
    base = ck.compute(torch.arange(3), full)
    assert base[0] == base[2] and base[0] != base[1]  # same bytes, same fingerprint
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # any single byte flipped changes it
        name = ["kv", "indexer"][int(torch.randint(0, 2, (1,), generator=g))]
        t = staging.tensor(name)
        layer = int(torch.randint(0, t.shape[0], (1,), generator=g))
        col = int(torch.randint(0, t.shape[2], (1,), generator=g))
        t[layer, 0, col] ^= 0x10
        assert ck.compute(torch.arange(1), full[:1]) != base[0]
        t[layer, 0, col] ^= 0x10
    kv_t = staging.tensor("kv")
    kv_t[[0, 1], 0] = kv_t[[1, 0], 0].clone()  # swap two layers' spans
    assert ck.compute(torch.arange(1), full[:1]) != base[0]
    # Bytes past valid_tokens do not count.
    kv_t[[0, 1], 0] = kv_t[[1, 0], 0].clone()
    one = torch.ones(1, dtype=torch.int64)
    before = ck.compute(torch.arange(1), one)
    kv_t[:, 0, 656:] ^= 0xFF
    assert ck.compute(torch.arange(1), one) == before


def test_corrupted_stored_object_is_detected_and_never_scattered(store, keyspace):
    kv = hybrid(32)
    mover = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=8, checksum=True,
                           key_prefix="integrity")
    try:
        keys = keyspace(3)
        src = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
        assert mover.evict(keys, src, valid_tokens=[4, 4, 3]).wait(30) == [
            kvmove.Status.OK] * 3
        # Corrupt the middle object through the raw Mooncake client: one byte flipped.
        raw = store._state.client
        store_key = mover.keyspace.store_keys(keys[1:2])[0]
        blob = bytearray(raw.get(store_key))
        assert len(blob) == mover.staging.object_bytes + 8
        blob[1000] ^= 0x01
        assert raw.remove(store_key, True) == 0
        assert raw.put(store_key, bytes(blob)) == 0
        before = snapshot(kv)
        dst = torch.tensor([[16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26, -1]])
        result = mover.prefetch(keys, dst, valid_tokens=[4, 4, 3]).result(30)
        assert result.statuses == [kvmove.Status.OK, kvmove.Status.FAILED, kvmove.Status.OK]
        assert result.codes[1] == CHECKSUM_MISMATCH
        after = snapshot(kv)
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                assert torch.equal(after[name][layer][20:24], before[name][layer][20:24])
                assert torch.equal(after[name][layer][16:20], before[name][layer][0:4])
                assert torch.equal(after[name][layer][24:27], before[name][layer][8:11])
        assert mover.staging.num_free == 8
    finally:
        mover.close()


@pytest.mark.parametrize("valid_tokens", [None, 3])
def test_checksummed_round_trip_with_shared_valid_tokens(store, keyspace, valid_tokens):
    """``valid_tokens`` given as None or one int is one read-only array shared between
    calls: the checksum's write and its check before the scatter read it without a write
    or a warning, and the bytes arrive."""
    kv = hybrid(16)
    v = 4 if valid_tokens is None else valid_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, checksum=True) as m:
            keys = keyspace(2)
            before = snapshot(kv)
            assert m.evict(keys, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),
                           valid_tokens=valid_tokens).wait(30) == [kvmove.Status.OK] * 2
            assert m.prefetch(keys, torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]]),
                              valid_tokens=valid_tokens).wait(30) == [kvmove.Status.OK] * 2
    after = snapshot(kv)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            got, was = after[name][layer], before[name][layer]
            for dst, src in ((8, 0), (12, 4)):
                assert torch.equal(got[dst:dst + v], was[src:src + v])
                assert torch.equal(got[dst + v:dst + 4], was[dst + v:dst + 4])  # past valid


def test_checksummed_and_plain_objects_live_in_different_namespaces(store, keyspace):
    kv = hybrid(16)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, checksum=True) as a, \
            kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4) as b:
        keys = keyspace(1)
        assert a.evict(keys, torch.tensor([[0, 1, 2, 3]])).wait(30) == [kvmove.Status.OK]
        assert b.prefetch(keys, torch.tensor([[4, 5, 6, 7]])).wait(30) == [kvmove.Status.MISS]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_trailer_bytes_is_validated(bad):
    with pytest.raises(ValueError, match="trailer_bytes"):
        kvmove.StagingBuffer(hybrid(4), num_slots=2, page_tokens=2, trailer_bytes=bad)


def test_with_trailer_appends_one_span_per_key():
    kv = hybrid(8)
    staging = kvmove.StagingBuffer(kv, num_slots=3, page_tokens=2, trailer_bytes=8)
    desc = kvmove.describe(staging, [2, 0], ["a", "b"], valid_tokens=[2, 1])
    tails = [staging.trailer[2].data_ptr(), staging.trailer[0].data_ptr()]
    before = ([list(p) for p in desc.ptrs], [list(s) for s in desc.sizes])
    out = desc.with_trailer(tails, 8)
    assert out.ptrs == [[*p, t] for p, t in zip(desc.ptrs, tails, strict=True)]
    assert out.sizes == [[*s, 8] for s in desc.sizes]
    assert [out.nbytes(i) for i in range(2)] == [desc.nbytes(i) + 8 for i in range(2)]
    assert (desc.ptrs, desc.sizes) == before  # the original (shared lists) is not mutated
    with pytest.raises(ValueError, match="trailer"):
        desc.with_trailer(tails[:1], 8)


# -- the function: the documented formula, every byte covered, any slots ------------------

def reference(staging, slot: int, valid: int, seed: int = 0x6B766D76) -> int:
    """docs/INTEGRITY.md's fingerprint of the page in ``slot``, in plain Python integers
    over its object bytes (``canonical``): no view, pick or einsum of the module's own."""
    g = torch.Generator().manual_seed(seed)
    obj, at, spans = canonical(staging, slot, valid), 0, []
    page_first = staging.layout == "page_first"
    for name in staging.buffer_names:
        rb, layers = staging.row_bytes(name), staging.num_layers(name)
        word = 4 if rb % 4 == 0 else 1
        per_span = rb * (layers if page_first else 1)
        weights = (torch.randint(0, 2**30, (staging.page_tokens * per_span // word,),
                                 generator=g, dtype=torch.int64) * 2 + 1).tolist()
        for local in range(1 if page_first else layers):
            words = np.frombuffer(obj[at:at + valid * per_span],
                                  dtype=np.int32 if word == 4 else np.uint8).tolist()
            spans.append((sum(x * w for x, w in zip(words, weights[:len(words)], strict=True)),
                          local))
            at += valid * per_span
    assert at == len(obj)
    total = sum(pow(_MIX, len(spans) - 1 - s, 2**64) * (span_sum + local + 1)
                for s, (span_sum, local) in enumerate(spans)) % 2**64
    return total - 2**64 if total >= 2**63 else total


def flip_bit(staging, slot: int, valid: int, offset: int, bit: int) -> None:
    """Flip bit ``bit`` of byte ``offset`` of the object of the page in ``slot``."""
    at = 0
    for name in staging.buffer_names:
        t, rb = staging.tensor(name), staging.row_bytes(name)
        if staging.layout == "page_first":  # one span: the slot's first valid tokens
            spans = [t[slot].reshape(-1)[:valid * rb * staging.num_layers(name)]]
        else:
            spans = [t[layer, slot, :valid * rb] for layer in range(t.shape[0])]
        for span in spans:
            if offset < at + span.numel():
                span[offset - at] ^= 1 << bit
                return
            at += span.numel()
    raise IndexError(offset)


def small_staging(layout: str, num_slots: int, page_tokens: int = 2):
    """Rows of 16 and 132 bytes (read as 32-bit words) and of 3 (read as bytes), random."""
    kv = kvmove.KVCache({"a": torch.zeros(2, 4, 16, dtype=torch.uint8),
                         "b": torch.zeros(1, 4, 132, dtype=torch.uint8),
                         "c": torch.zeros(2, 4, 3, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens,
                                   trailer_bytes=TRAILER_BYTES, layout=layout)
    g = torch.Generator().manual_seed(7)
    for name in staging.buffer_names:
        t = staging.tensor(name)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return staging


def copy_slot(staging, src: int, dst: slice) -> None:
    for name in staging.buffer_names:
        t = staging.tensor(name)
        if staging.layout == "page_first":
            t[dst] = t[src:src + 1]
        else:
            t[:, dst] = t[:, src:src + 1]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("valid", [2, 1])
def test_every_single_bit_flip_of_a_page_is_caught(layout, valid):
    """Slot 0 holds a page; slot ``k`` the same page with one bit flipped, for every bit of
    every byte of its object: every fingerprint differs from slot 0's (one call, all)."""
    object_bytes = valid * (2 * 16 + 132 + 2 * 3)
    staging = small_staging(layout, num_slots=1 + 8 * object_bytes)
    copy_slot(staging, 0, slice(1, None))
    for k in range(8 * object_bytes):
        flip_bit(staging, 1 + k, valid, k // 8, k % 8)
    n = staging.num_slots
    prints = PageChecksum(staging).compute(torch.arange(n), torch.full((n,), valid))
    assert prints[0] == reference(staging, 0, valid)
    assert bool((prints[1:] != prints[0]).all())
    assert len(set(prints[1:].tolist())) == n - 1  # and no two flips collide


def test_fingerprint_is_pinned():
    """The function is part of the object format (these are the values of kvmove's earlier
    per-layer loop): a change makes every object another version stored read FAILED."""
    kv = kvmove.KVCache({"kv": torch.zeros(2, 4, 656, dtype=torch.uint8),
                         "indexer": torch.zeros(1, 4, 132, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=2, trailer_bytes=8)
    for i, name in enumerate(staging.buffer_names):
        t = staging.tensor(name)
        t.copy_((torch.arange(t.numel()) * (7 + i) % 251).to(torch.uint8).view(t.shape))
    got = PageChecksum(staging).compute(torch.tensor([1, 0]), torch.tensor([2, 1]))
    assert got.tolist() == [reference(staging, 1, 2), reference(staging, 0, 1)]
    assert got.tolist() == PINNED


def test_bad_arguments_name_themselves():
    ck = PageChecksum(small_staging("layer_first", num_slots=3))
    with pytest.raises(ValueError, match="slots"):
        ck.compute(torch.tensor([0, 3]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="valid_tokens"):
        ck.compute(torch.tensor([0, 1]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="valid_tokens"):
        ck.compute(torch.tensor([0, 1]), torch.tensor([1]))
    assert ck.compute(torch.tensor([], dtype=torch.int64), torch.tensor([])).numel() == 0


@st.composite
def staged_pages(draw):
    """A staging (1-2 buffers of the odd row sizes, 1-3 layers, either layout) of random
    bytes, some of its slots in any order (a run or not) and each page's valid tokens."""
    page_tokens = draw(st.integers(1, 4))
    buffers = {f"b{i}": (draw(st.integers(1, 3)), draw(st.sampled_from(ROW_BYTES)))
               for i in range(draw(st.integers(1, 2)))}
    kv = kvmove.KVCache({name: torch.zeros(layers, 2, rb, dtype=torch.uint8)
                         for name, (layers, rb) in buffers.items()})
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens, trailer_bytes=8,
                                   layout=draw(st.sampled_from(["layer_first", "page_first"])))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    for name in staging.buffer_names:
        t = staging.tensor(name)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    if draw(st.booleans()):
        first = draw(st.integers(0, 5))
        slots = list(range(first, draw(st.integers(first + 1, 6))))
    else:
        slots = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
    valid = [draw(st.integers(1, page_tokens)) for _ in slots]
    return staging, slots, valid


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staged_pages(), st.data())
def test_fingerprints_follow_the_formula_over_the_object_bytes_only(case, data):
    staging, slots, valid = case
    ck = PageChecksum(staging)
    got = ck.compute(torch.tensor(slots), torch.tensor(valid)).tolist()
    assert got == [reference(staging, s, v) for s, v in zip(slots, valid, strict=True)]
    # the same bytes in another staging of that geometry (another process) print the same
    assert PageChecksum(staging).compute(torch.tensor(slots[:1]), torch.tensor(valid[:1])
                                         ).tolist() == got[:1]
    # one flipped bit anywhere in page 0's object changes its print, and only its print
    object_bytes = len(canonical(staging, slots[0], valid[0]))
    offset, bit = data.draw(st.integers(0, object_bytes - 1)), data.draw(st.integers(0, 7))
    flip_bit(staging, slots[0], valid[0], offset, bit)
    after = ck.compute(torch.tensor(slots), torch.tensor(valid)).tolist()
    assert after[0] != got[0] and after[1:] == got[1:]
    flip_bit(staging, slots[0], valid[0], offset, bit)
    # bytes past the valid tokens are not part of the object
    if valid[0] < staging.page_tokens:
        for name in staging.buffer_names:
            t = staging.tensor(name)
            if staging.layout == "page_first":
                t[slots[0], valid[0]:] ^= 0xFF
            else:
                t[:, slots[0], valid[0] * staging.row_bytes(name):] ^= 0xFF
        assert ck.compute(torch.tensor(slots), torch.tensor(valid)).tolist() == got


# -- through the store: a flipped bit in every span of a stored object ----------------------

def span_offsets(staging, valid: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each span of an object, the trailer last."""
    out, at = [], 0
    for name in staging.buffer_names:
        rb, layers = staging.row_bytes(name), staging.num_layers(name)
        sizes = ([valid * rb * layers] if staging.layout == "page_first"
                 else [valid * rb] * layers)
        for size in sizes:
            out.append((at, size))
            at += size
    return [*out, (at, TRAILER_BYTES)]


@pytest.mark.parametrize(("layout", "layerwise"), [("layer_first", False),
                                                  ("layer_first", True),
                                                  ("page_first", False)])
def test_a_flipped_bit_in_any_span_of_a_stored_object_reads_failed(store, keyspace, layout,
                                                                   layerwise):
    """Objects of one page, each with one bit flipped in another span (its first, a middle
    and its last byte; the trailer too), read FAILED with CHECKSUM_MISMATCH; none of their
    bytes reaches the KV rows (whole or layer by layer), and an intact copy reads OK."""
    valid, page = 3, 4
    staging_probe = kvmove.StagingBuffer(hybrid(4), num_slots=1, page_tokens=page,
                                         layout=layout)
    flips = [(off + pos, (s + pos) % 8)
             for s, (off, size) in enumerate(span_offsets(staging_probe, valid))
             for pos in (0, size // 2, size - 1)]
    staging_probe.close()
    n = len(flips) + 1  # the last key stays intact
    kv = hybrid(page * (n + 1))
    with kvmove.KVMover(kv, store, page_tokens=page, staging_slots=8, checksum=True,
                        layout=layout, key_prefix="integrity") as mover:
        keys = keyspace(n)
        src = torch.arange(page).repeat(n, 1)  # every key: the same page
        assert mover.evict(keys, src, valid_tokens=valid).wait(60) == [kvmove.Status.OK] * n
        raw = store.raw_client
        for key, (offset, bit) in zip(mover.keyspace.store_keys(keys[:-1]), flips,
                                      strict=True):
            blob = bytearray(raw.get(key))
            assert len(blob) == span_offsets(mover.staging, valid)[-1][0] + TRAILER_BYTES
            blob[offset] ^= 1 << bit
            assert raw.remove(key, True) == 0
            assert raw.put(key, bytes(blob)) == 0
        before = snapshot(kv)
        dst = torch.arange(page, page * (n + 1)).reshape(n, page)
        result = mover.prefetch(keys, dst, valid_tokens=valid, layerwise=layerwise).result(60)
    assert result.statuses == [kvmove.Status.FAILED] * (n - 1) + [kvmove.Status.OK]
    assert result.codes[:-1] == [CHECKSUM_MISMATCH] * (n - 1)
    after = snapshot(kv)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            got, was = after[name][layer], before[name][layer]
            assert torch.equal(got[page:page * n], was[page:page * n])  # corrupt: untouched
            last = page * n
            assert torch.equal(got[last:last + valid], was[:valid])  # intact: arrived
            assert torch.equal(got[last + valid:], was[last + valid:])


def test_checksum_rules_out_the_in_place_path(store):
    """The checksum is made and checked in staging: asked for in place it is refused, and
    ``path="auto"`` stages."""
    kv = hybrid(8)
    with pytest.raises(ValueError, match="checksum"):
        kvmove.KVMover(kv, store, page_tokens=2, staging_slots=2, checksum=True,
                       path="in_place")
    with kvmove.KVMover(kv, store, page_tokens=2, staging_slots=2, checksum=True) as mover:
        assert mover.path == "staged"


def test_checksummed_objects_never_pass_for_an_engines_own(store, keyspace):
    """With ``raw_keys=True`` (an engine's keys) a checksummed object is 8 bytes longer than
    the engine's own object of that key: each side reads the other's as SIZE_MISMATCH, never
    OK, and leaves the rows untouched."""
    kv = hybrid(16)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, raw_keys=True,
                        checksum=True) as checked, \
            kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, raw_keys=True,
                           path="staged") as plain:
        mine, theirs = keyspace(1, "ck"), keyspace(1, "plain")
        src = torch.tensor([[0, 1, 2, 3]])
        assert checked.evict(mine, src).wait(30) == [kvmove.Status.OK]
        assert plain.evict(theirs, src).wait(30) == [kvmove.Status.OK]
        before = snapshot(kv)
        dst = torch.tensor([[8, 9, 10, 11]])
        assert plain.prefetch(mine, dst).wait(30) == [kvmove.Status.SIZE_MISMATCH]
        assert checked.prefetch(theirs, dst).wait(30) == [kvmove.Status.SIZE_MISMATCH]
    after = snapshot(kv)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            assert torch.equal(after[name][layer], before[name][layer])


def test_the_checksum_benchmark_runs_and_reports_its_goal(tmp_path):
    """``bench/bench_checksum.py`` end to end on a tiny case: every figure it reports is
    there (no timing is asserted)."""
    import json

    from bench import bench_checksum

    out = tmp_path / "checksum.json"
    assert bench_checksum.main(["--layers", "2", "--pages", "2", "--page-tokens", "1", "2",
                                "--caches", "stacked", "per_layer", "--repeat", "1",
                                "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["cache"], c["page_tokens"]) for c in cases] == [
        ("stacked", 1), ("per_layer", 1), ("stacked", 2), ("per_layer", 2)]
    for c in cases:
        assert c["goal"] == 1.05 and isinstance(c["met"], bool)
        assert c["paths"]["checksum"] == "staged" and c["paths"]["staged"] == "staged"
        assert set(c["median_ms"]) >= {"evict + prefetch (staged)", "checksum alone",
                                       "evict + prefetch (checksum)", "evict + prefetch (auto)"}
        assert all(v >= 0 for v in c["spread"].values())
