"""KVMover against a real embedded Mooncake master: evict -> overwrite -> prefetch into other
slots reproduces the bytes, for MLA-like, MHA and hybrid caches, with padding, partial pages,
misses, layer-wise prefetch, back-pressure, concurrency and close with work in flight."""

from __future__ import annotations

import threading

import pytest
import torch

import kvmove
from kvmove import mover as mover_module
from tests.caches import make_layers, snapshot

GEOMETRIES = {
    "mla": lambda slots: {"kv": make_layers(4, slots, 656, torch.uint8, stacked=True, seed=1)},
    "mha": lambda slots: {"k": make_layers(3, slots, 576, torch.bfloat16, seed=2),
                          "v": make_layers(3, slots, 576, torch.bfloat16, seed=3)},
    "hybrid": lambda slots: {"kv": make_layers(5, slots, 1152, torch.bfloat16, seed=4),
                             "indexer": make_layers(2, slots, 132, torch.uint8, pitch_pad=4,
                                                    seed=5)},
}


@pytest.fixture
def make_mover(store):
    """Movers that are closed after the test, checking their staging is back to full."""
    movers = []

    def make(kv, **kwargs):
        kwargs.setdefault("page_tokens", 4)
        kwargs.setdefault("staging_slots", 16)
        m = kvmove.KVMover(kv, store, key_prefix=kwargs.pop("key_prefix", "t"), **kwargs)
        movers.append(m)
        return m

    yield make
    for m in movers:
        m.close()
        assert m.staging.num_free == m.staging.num_slots


def rows_of(kv, name, layer, rows):
    return kv.layer(name, layer)[torch.as_tensor(rows)].clone()


def scribble(kv, rows):
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            kv.layer(name, layer)[torch.as_tensor(rows)] = 0x5A


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_evict_overwrite_prefetch_elsewhere_reproduces_bytes(geometry, make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES[geometry](64))
    mover = make_mover(kv)
    keys = keyspace(3)
    src = torch.tensor([[0, 5, 9, 2], [10, 11, -1, 13], [40, 41, 42, 43]])
    dst = torch.tensor([[20, 21, 22, 23], [30, 31, -1, 33], [50, 51, 52, 53]])
    want = {(n, layer): [rows_of(kv, n, layer, r[r >= 0]) for r in src]
            for n in kv.buffer_names for layer in range(kv.num_layers(n))}
    t = mover.evict(keys, src)
    assert t.gathered.query() is True  # CPU: the gather is finished
    scribble(kv, src[src >= 0])  # the engine reuses the evicted rows
    assert t.wait(timeout=30) == [kvmove.Status.OK] * 3
    untouched = rows_of(kv, kv.buffer_names[0], 0, [32])
    p = mover.prefetch(keys, dst)
    assert p.wait(timeout=30) == [kvmove.Status.OK] * 3
    for (n, layer), pages in want.items():
        for page, d in zip(pages, dst, strict=True):
            assert torch.equal(rows_of(kv, n, layer, d[d >= 0]), page), (n, layer)
    assert torch.equal(rows_of(kv, kv.buffer_names[0], 0, [32]), untouched)  # padding target


def test_prefetch_miss_leaves_rows_untouched_while_others_succeed(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](32))
    mover = make_mover(kv)
    keys = keyspace(3)
    assert mover.evict([keys[0], keys[2]], torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])).wait(
        timeout=30) == [kvmove.Status.OK] * 2
    before = snapshot(kv)
    result = mover.prefetch(keys, torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15],
                                                [16, 17, 18, 19]])).result(timeout=30)
    assert result.statuses == [kvmove.Status.OK, kvmove.Status.MISS, kvmove.Status.OK]
    assert result.codes[1] == -704
    after = snapshot(kv)
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            assert torch.equal(after[n][layer][12:16], before[n][layer][12:16])
            assert torch.equal(after[n][layer][8:12], before[n][layer][0:4])
            assert torch.equal(after[n][layer][16:20], before[n][layer][4:8])


def test_partial_pages_round_trip_with_valid_tokens(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv)
    keys = keyspace(2)
    pages = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]])
    assert mover.evict(keys, pages, valid_tokens=[4, 2]).wait(timeout=30) == [
        kvmove.Status.OK] * 2
    before = snapshot(kv)
    # The wrong size (a full page for the partial one) is a SIZE_MISMATCH and writes nothing.
    statuses = mover.prefetch(keys[1:], torch.tensor([[20, 21, 22, 23]])).wait(timeout=30)
    assert statuses == [kvmove.Status.SIZE_MISMATCH]
    for layer in range(4):
        assert torch.equal(kv.layer("kv", layer)[20:24], before["kv"][layer][20:24])
    statuses = mover.prefetch(keys, torch.tensor([[8, 9, 10, 11], [12, 13, -1, -1]]),
                              valid_tokens=[4, 2]).wait(timeout=30)
    assert statuses == [kvmove.Status.OK] * 2
    for layer in range(4):
        assert torch.equal(kv.layer("kv", layer)[8:12], before["kv"][layer][0:4])
        assert torch.equal(kv.layer("kv", layer)[12:14], before["kv"][layer][4:6])
        assert torch.equal(kv.layer("kv", layer)[14:16], before["kv"][layer][14:16])


def test_second_evict_of_a_key_reports_exists_and_keeps_the_first_object(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    mover = make_mover(kv)
    key = keyspace(1)
    first = [kv.layer("kv", layer)[0:4].clone() for layer in range(4)]
    assert mover.evict(key, torch.tensor([[0, 1, 2, 3]])).wait(30) == [kvmove.Status.OK]
    assert mover.evict(key, torch.tensor([[4, 5, 6, 7]])).wait(30) == [kvmove.Status.EXISTS]
    assert mover.prefetch(key, torch.tensor([[8, 9, 10, 11]])).wait(30) == [kvmove.Status.OK]
    for layer in range(4):
        assert torch.equal(kv.layer("kv", layer)[8:12], first[layer])


def test_keys_are_namespaced_by_geometry_and_prefix(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    keys = keyspace(1)
    a = make_mover(kv, key_prefix="model-a")
    assert a.evict(keys, torch.tensor([[0, 1, 2, 3]])).wait(30) == [kvmove.Status.OK]
    other_prefix = make_mover(kv, key_prefix="model-b")
    assert other_prefix.prefetch(keys, torch.tensor([[4, 5, 6, 7]])).wait(30) == [
        kvmove.Status.MISS]
    other_pages = make_mover(kv, key_prefix="model-a", page_tokens=2)
    assert other_pages.prefetch(keys, torch.tensor([[4, 5]])).wait(30) == [kvmove.Status.MISS]
    assert other_pages.keyspace.fingerprint != a.keyspace.fingerprint
    with pytest.raises(ValueError, match="key_prefix"):
        make_mover(kv, key_prefix="bad prefix/with spaces")


def test_layerwise_prefetch_makes_layer_0_available_before_the_call_ends(
        make_mover, keyspace, monkeypatch):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](32))
    mover = make_mover(kv)
    keys = keyspace(2)
    src = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    want = snapshot(kv)
    assert mover.evict(keys, src).wait(30) == [kvmove.Status.OK] * 2
    release = threading.Event()
    real_scatter = mover_module.scatter

    def slow_scatter(*args, layers=None, **kwargs):
        if layers == 1:  # a slow consumer: layer 1 waits until the test has seen layer 0
            assert release.wait(30)
        return real_scatter(*args, layers=layers, **kwargs)

    monkeypatch.setattr(mover_module, "scatter", slow_scatter)
    t = mover.prefetch(keys, torch.tensor([[16, 17, 18, 19], [20, 21, 22, 23]]),
                       layerwise=True)
    t.wait_layer(0, timeout=30)
    assert not t.done()
    for n in kv.buffer_names:
        assert torch.equal(kv.layer(n, 0)[16:24], want[n][0][0:8])
        assert not torch.equal(kv.layer(n, 1)[16:24], want[n][1][0:8])
    with pytest.raises(TimeoutError):
        t.wait_layer(1, timeout=0.05)
    release.set()
    assert t.wait(30) == [kvmove.Status.OK] * 2
    for layer in range(kv.max_layers):
        t.wait_layer(layer, timeout=1)
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            assert torch.equal(kv.layer(n, layer)[16:24], want[n][layer][0:8])


def test_eight_threads_evicting_and_prefetching_lose_nothing(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](8 * 2 * 3 * 4))
    mover = make_mover(kv, staging_slots=8, workers=3)
    want = snapshot(kv)
    keys = keyspace(8 * 3)
    errors = []

    def worker(w):
        try:
            for r in range(3):
                key = [keys[w * 3 + r]]
                base = (w * 3 + r) * 8
                src = torch.arange(base, base + 4)[None, :]
                assert mover.evict(key, src).wait(30) == [kvmove.Status.OK]
                assert mover.prefetch(key, src + 4).wait(30) == [kvmove.Status.OK]
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            got = kv.layer(n, layer).reshape(-1, 2, 4, kv.row_bytes(n))
            ref = want[n][layer].reshape(-1, 2, 4, kv.row_bytes(n))
            assert torch.equal(got[:, 1], ref[:, 0])  # each prefetched page = its evicted page


def test_close_with_transfers_in_flight_finishes_them(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](64))
    mover = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=16, key_prefix="close")
    keys = keyspace(16)
    transfers = [mover.evict(keys[i:i + 2], torch.arange(4 * i, 4 * i + 8).reshape(2, 4))
                 for i in range(0, 16, 2)]
    mover.close()
    assert all(t.done() for t in transfers)
    assert [s for t in transfers for s in t.wait(0)] == [kvmove.Status.OK] * 16
    assert store.exists(mover.keyspace.store_keys(keys)) == [True] * 16
    assert mover.staging.num_free == 16
    with pytest.raises(kvmove.KVMoveError, match="closed"):
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]))


def test_full_staging_applies_back_pressure_then_raises(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv, staging_slots=2, alloc_timeout=0.2)
    with pytest.raises(kvmove.StagingFull, match="split the batch"):
        mover.evict(keyspace(3), torch.zeros(3, 4, dtype=torch.int64))
    held = mover.staging.alloc(2)
    with pytest.raises(kvmove.StagingFull):
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]))
    threading.Timer(0.1, mover.staging.free, args=(held,)).start()
    mover.alloc_timeout = 10
    assert mover.evict(keyspace(1, "late"), torch.tensor([[0, 1, 2, 3]])).wait(30) == [
        kvmove.Status.OK]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m, k: m.evict(k(2), torch.zeros(1, 4, dtype=torch.int64)), ValueError, "pages"),
        (lambda m, k: m.evict(k(1), torch.zeros(1, 3, dtype=torch.int64)), ValueError,
         "page_tokens"),
        (lambda m, k: m.evict(["a", "a"], torch.zeros(2, 4, dtype=torch.int64)), ValueError,
         "repeats"),
        (lambda m, k: m.evict([""], torch.zeros(1, 4, dtype=torch.int64)), ValueError, "empty"),
        (lambda m, k: m.evict(k(1), torch.tensor([[0, 1, 2, 99]])), IndexError, "token_pages"),
        (lambda m, k: m.evict(k(1), torch.zeros(1, 4)), TypeError, "token_pages"),
        (lambda m, k: m.evict(k(1), torch.zeros(1, 4, dtype=torch.int64), valid_tokens=5),
         ValueError, "valid_tokens"),
        (lambda m, k: m.prefetch(k(2), torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]])),
         ValueError, "more than once"),
        (lambda m, k: m.evict("abc", torch.zeros(1, 4, dtype=torch.int64)), TypeError, "keys"),
    ],
)
def test_bad_calls_raise_and_keep_staging_full(make_mover, keyspace, call, error, match):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv)
    before = snapshot(kv)
    with pytest.raises(error, match=match):
        call(mover, keyspace)
    assert mover.staging.num_free == mover.staging.num_slots
    after = snapshot(kv)
    assert all(torch.equal(a, b) for a, b in zip(before["kv"], after["kv"], strict=True))
