"""KVCache and StagingBuffer: validation, layout, memory, and the thread-safe slot pool."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.row_numbers import page_rows, page_rows_on_device
from tests.support.caches import make_layers
from tests.support.threads import run_threads


def test_cache_describes_buffers():
    kv = kvmove.KVCache({
        "kv": make_layers(3, 10, 656, torch.uint8),
        "indexer": make_layers(2, 10, 132, torch.float32, stacked=True),
    })
    assert kv.buffer_names == ["kv", "indexer"]
    assert (kv.num_layers("kv"), kv.num_layers("indexer")) == (3, 2)
    assert (kv.row_bytes("kv"), kv.row_bytes("indexer")) == (656, 132)
    assert kv.num_slots == 10 and kv.device == torch.device("cpu")
    assert kv.dtype("indexer") == torch.float32
    with pytest.raises(KeyError, match="nope"):
        kv.row_bytes("nope")


def test_cache_views_the_engines_memory_without_copying():
    layers = make_layers(2, 6, 132, torch.float32, pitch_pad=5)
    kv = kvmove.KVCache({"kv": layers})
    kv.layer("kv", 1)[4] = 7
    assert torch.equal(layers[1][4].reshape(-1).view(torch.uint8), torch.full((132,), 7,
                                                                               dtype=torch.uint8))


@pytest.mark.parametrize(
    ("buffers", "error", "match"),
    [
        ({}, ValueError, "at least one"),
        ([torch.zeros(2, 4)], TypeError, "mapping"),
        ({"kv": []}, ValueError, "no layers"),
        ({"kv": "abc"}, TypeError, "sequence"),
        ({"kv": [torch.zeros(4, 8), 3]}, TypeError, "layer 1"),
        ({"kv": [torch.zeros(4, 8), torch.zeros(4, 9)]}, ValueError, "layer 1"),
        ({"kv": [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)]}, ValueError, "dtype"),
        ({"kv": [torch.zeros(4, 8)], "v": [torch.zeros(5, 8)]}, ValueError, "num_slots"),
        ({"kv": [torch.zeros(8, 4).t()]}, ValueError, "contiguous"),
        ({"kv": torch.zeros(4)}, ValueError, "stacked"),
        ({"": [torch.zeros(4, 8)]}, ValueError, "names"),
        ({"kv": [torch.zeros(0, 8)]}, ValueError, "num_slots > 0"),
    ],
)
def test_cache_rejects_bad_descriptions(buffers, error, match):
    with pytest.raises(error, match=match):
        kvmove.KVCache(buffers)


def test_staging_is_layer_first_and_page_aligned():
    kv = kvmove.KVCache({"k": make_layers(3, 8, 132, torch.uint8),
                         "v": make_layers(1, 8, 4100, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=5, page_tokens=7)
    assert staging.tensor("k").shape == (3, 5, 7 * 132)
    assert staging.tensor("v").shape == (1, 5, 7 * 4100)
    assert staging.tensor("k").dtype == torch.uint8
    regions = staging.regions()
    assert regions == [(staging.tensor(n).data_ptr(), staging.tensor(n).numel())
                       for n in ("k", "v")]
    assert all(addr % mmap.PAGESIZE == 0 for addr, _ in regions)
    assert staging.object_bytes == 3 * 7 * 132 + 7 * 4100
    assert not staging.pinned  # no CUDA here


@pytest.mark.parametrize("kwargs", [{"num_slots": 0}, {"page_tokens": 0},
                                    {"num_slots": 2.5}, {"page_tokens": True}])
def test_staging_rejects_bad_sizes(kwargs):
    kv = kvmove.KVCache({"kv": make_layers(1, 4, 4, torch.uint8)})
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        kvmove.StagingBuffer(kv, **kwargs)


def test_alloc_and_free():
    kv = kvmove.KVCache({"kv": make_layers(1, 4, 4, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    a = staging.alloc(3)
    assert a.dtype == torch.int64 and a.tolist() == [0, 1, 2]
    with pytest.raises(kvmove.StagingFull):
        staging.alloc(2)
    assert staging.num_free == 1  # the failed alloc took nothing
    staging.free(a[1:2])
    assert staging.alloc(2).tolist() == [1, 3]
    with pytest.raises(ValueError, match="twice"):
        staging.free(torch.tensor([0, 0]))
    staging.free(torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="not allocated"):
        staging.free([2])
    with pytest.raises(ValueError, match="out of range"):
        staging.free([4])
    assert staging.num_free == 4
    assert isinstance(kvmove.StagingFull("x"), kvmove.KVMoveError)


def test_free_of_a_partly_allocated_set_frees_nothing():
    kv = kvmove.KVCache({"kv": make_layers(1, 4, 4, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    staging.alloc(2)
    with pytest.raises(ValueError):
        staging.free([1, 2])
    assert staging.num_free == 2


def test_alloc_waits_for_slots_when_asked():
    kv = kvmove.KVCache({"kv": make_layers(1, 4, 4, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=1)
    held = staging.alloc(2)
    threading.Timer(0.2, staging.free, args=(held,)).start()
    assert staging.alloc(2, timeout=5).tolist() == [0, 1]
    with pytest.raises(kvmove.StagingFull):
        staging.alloc(1, timeout=0.05)


def test_allocator_is_thread_safe():
    kv = kvmove.KVCache({"kv": make_layers(1, 4, 4, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=64, page_tokens=1)
    owner = [None] * 64
    failures = []

    def worker(me):
        for i in range(300):
            slots = staging.alloc(1 + (i + me) % 5, timeout=None)
            for s in slots.tolist():
                if owner[s] is not None:
                    failures.append((s, owner[s], me))
                owner[s] = me
            for s in slots.tolist():
                owner[s] = None
            staging.free(slots)

    run_threads(worker, 8)
    assert failures == []
    assert staging.num_free == 64


def test_wide_copies_follow_the_storage_offset_not_only_the_address():
    """A layer whose rows are 8-byte aligned in memory but sit at an odd offset of their
    storage (torch.frombuffer with an offset) cannot be viewed as int64: the copy must
    still be right (in narrower words)."""
    buf = bytearray(64 * 656 + 64)
    odd = torch.frombuffer(buf, dtype=torch.uint8, offset=1)
    shift = (-odd.data_ptr()) % 8
    layer = odd[shift:shift + 64 * 656].view(64, 656)
    layer.copy_(torch.randint(0, 256, layer.shape, dtype=torch.uint8))
    kv = kvmove.KVCache({"kv": [layer]})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    rows = kv.row_pool.buffers["kv"]
    assert rows.widest_type(16).itemsize == 1 or layer.storage_offset() % 8 == 0
    pages, slots = torch.arange(32).view(2, 16), torch.tensor([3, 1])
    kvmove.gather(kv, staging, pages, slots, backend="torch")
    for p, slot in enumerate(slots.tolist()):
        assert torch.equal(staging.tensor("kv")[0, slot].view(16, 656), layer[16 * p:16 * p + 16])
    before = layer.clone()
    kvmove.scatter(staging, torch.tensor([1]), kv, torch.arange(16, 32).view(1, 16) + 16,
                   backend="torch")
    expect = before.clone()
    expect[32:48] = staging.tensor("kv")[0, 1].view(16, 656)
    assert torch.equal(layer, expect)


def test_run_views_keep_only_the_latest_runs_under_threads():
    from kvmove.memory.row_pool import RUN_VIEWS_KEPT

    kv = kvmove.KVCache({"k": torch.zeros(4, 512, 64, dtype=torch.uint8)})
    rows = kv.row_pool.buffers["k"]

    def work(t: int) -> None:
        for i in range(2000):
            start = (t * 7919 + i * 31) % 500
            views = rows.run_views(1, start, 3)
            assert views[2].data_ptr() == rows.layers[2][start].data_ptr()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rows._runs) <= RUN_VIEWS_KEPT
    rows.run_views(1, 7, 2)
    assert next(reversed(rows._runs)) == (1, 7, 2, torch.uint8)  # the latest is kept last


@settings(max_examples=40, deadline=None)
@given(slots=st.lists(st.integers(-1, 500), max_size=20), page_tokens=st.integers(1, 70),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_page_rows_in_numpy_and_on_a_device_agree(slots, page_tokens, dtype):
    """Staging row numbers of pages: slot s -> rows s * page_tokens + t, -1 -> -1 (the
    device version runs here on the CPU)."""
    t = torch.tensor(slots, dtype=dtype)
    expected = [-1 if s == -1 else s * page_tokens + i for s in slots for i in range(page_tokens)]
    assert page_rows(t, page_tokens).tolist() == expected
    assert page_rows_on_device(t, page_tokens).tolist() == expected


@pytest.mark.parametrize("page_tokens", [1, 3, 64])
def test_page_rows_never_wrap_around_onto_real_rows(page_tokens):
    """Slots whose rows would overflow int64 (or be negative) give rows of -2: out of range,
    never a row that exists."""
    limit = (2**63 - 1 - page_tokens + 1) // page_tokens  # the largest slot that fits
    values = [2**62, 2**63 - 1, limit, min(limit + 1, 2**63 - 1), -2, -(2**62), -(2**63), -1, 5]

    def rows_of(s):
        if s == -1:
            return [-1] * page_tokens
        if s < -1 or s > limit:
            return [-2] * page_tokens
        return [s * page_tokens + t for t in range(page_tokens)]

    slots = torch.tensor(values)
    expected = [r for s in values for r in rows_of(s)]
    assert page_rows(slots, page_tokens).tolist() == expected
    assert page_rows_on_device(slots, page_tokens).tolist() == expected


def test_unchecked_gather_counts_a_slot_past_int64_and_writes_nothing():
    kv = kvmove.KVCache({"kv": [torch.arange(512, dtype=torch.int64).view(32, 16)]})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=16)
    staging.tensor("kv").zero_()
    errors = kvmove.gather(kv, staging, torch.arange(16, 32)[None], torch.tensor([2**62]),
                           backend="torch", check=False)
    assert int(errors) == 16
    assert not staging.tensor("kv").any()


def test_run_views_refuse_runs_past_the_pool():
    """A run of units must lie inside the pool: a slice would silently come back shorter
    (and a copy into it broadcast), so a run past the end raises."""
    kv = kvmove.KVCache({"kv": [torch.zeros(10, 8, dtype=torch.uint8)]})
    rows = kv.row_pool.buffers["kv"]
    assert rows.run_views(2, 3, 2)[0].shape == (2, 16)  # units 3 and 4: rows 6..9
    for start, count in ((4, 2), (-1, 1), (0, 6)):
        with pytest.raises(IndexError, match="outside"):
            rows.run_views(2, start, count)
