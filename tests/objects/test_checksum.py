"""End-to-end object checksums: computed while staging, stored with the object, verified
before any scatter. A corrupted stored object is a per-key failure and no corrupt byte
reaches the KV cache."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvmove
from kvmove.objects.checksum import PageChecksum
from kvmove.status import CHECKSUM_MISMATCH
from tests.support.caches import make_layers, snapshot


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
