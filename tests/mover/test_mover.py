"""KVMover against a real embedded Mooncake master: evict -> overwrite -> prefetch into other
slots reproduces the bytes, for MLA-like, MHA and hybrid caches, with padding, partial pages,
misses, layer-wise prefetch, back-pressure, concurrency and close with work in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvmove
from kvmove.mover import kv_mover as mover_module
from kvmove.mover import staged_path
from kvmove.status import BAD_ROWS, STAGING_TIMEOUT
from tests.support.caches import GEOMETRIES, snapshot, write_random
from tests.support.threads import run_threads


@pytest.fixture
def make_mover(store):
    """Movers that are closed after the test, checking their staging is back to full."""
    movers = []

    def make(kv, **kwargs):
        kwargs.setdefault("page_tokens", 4)
        kwargs.setdefault("staging_slots", 16)
        kwargs.setdefault("path", "staged")  # these tests are about the staged path
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


class PlainPendingPut:
    """A begun put that asks the master nothing early: its put is the store's plain put
    (the exists check inside it), looked up when it is made."""

    def __init__(self, store, options: dict):
        self._store, self._options = store, options

    def put(self, desc):
        return self._store.put(desc, **self._options)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def plain_begin_put(store):
    """A ``begin_put`` for ``store`` whose puts are plain puts."""
    return lambda keys, **options: PlainPendingPut(store, options)


@pytest.mark.parametrize("path", ["staged", "in_place"])
@pytest.mark.parametrize("begin_put", [True, False], ids=["begin_put", "plain_put"])
def test_second_evict_of_a_key_reports_exists_and_keeps_the_first_object(
        make_mover, keyspace, monkeypatch, path, begin_put):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    mover = make_mover(kv, path=path)
    begun = []
    if begin_put:  # staged, the exists check starts while the gather ends
        real = mover.store.begin_put
        monkeypatch.setattr(mover.store, "begin_put",
                            lambda keys: begun.append(list(keys)) or real(keys))
    else:  # a begin_put that only puts later: the put checks
        monkeypatch.setattr(mover.store, "begin_put", plain_begin_put(mover.store))
    key = keyspace(1)
    first = [kv.layer("kv", layer)[0:4].clone() for layer in range(4)]
    assert mover.evict(key, torch.tensor([[0, 1, 2, 3]])).wait(30) == [kvmove.Status.OK]
    assert mover.evict(key, torch.tensor([[4, 5, 6, 7]])).wait(30) == [kvmove.Status.EXISTS]
    staged_begun = begin_put and path == "staged"  # in place the put checks inside
    assert begun == ([mover.keyspace.store_keys(key)] * 2 if staged_begun else [])
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


def test_layer_groups_start_with_layer_0_alone_and_double():
    assert mover_module.layer_groups(61) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16),
                                             (16, 32), (32, 61)]
    for n in range(1, 130):
        groups = mover_module.layer_groups(n)
        assert [g[0] for g in groups] == [0] + [g[1] for g in groups[:-1]]  # in order
        assert groups[0] == (0, 1) and groups[-1][1] == n
        for first, end in groups:
            assert 0 < end - first <= max(1, first)  # layer l >= 1 comes with layers < 2l
        assert len(groups) <= n.bit_length() + 1


@pytest.mark.parametrize("held", [1, 2])
def test_a_layerwise_prefetch_places_each_group_of_layers_before_the_next(
        make_mover, keyspace, monkeypatch, held):
    # Five layers: groups 0, 1, 2-3, 4. While group ``held`` is held (a slow consumer), the
    # layers before it are in place in every buffer (the two-layer one is whole with group
    # 1), the others are not, and the call has not ended.
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](32))
    assert kv.max_layers == 5
    mover = make_mover(kv)
    keys = keyspace(2)
    src = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    want = snapshot(kv)
    assert mover.evict(keys, src).wait(30) == [kvmove.Status.OK] * 2
    copy, _ = mover._copies.scatter_groups[held]
    first = mover_module.layer_groups(5)[held][0]
    release = threading.Event()
    real_copy = staged_path.run_pages

    def slow_copy(prepared, *args):
        if prepared is copy:
            assert release.wait(30)
        return real_copy(prepared, *args)

    monkeypatch.setattr(staged_path, "run_pages", slow_copy)
    t = mover.prefetch(keys, torch.tensor([[16, 17, 18, 19], [20, 21, 22, 23]]),
                       layerwise=True)
    t.wait_layer(first - 1, timeout=30)
    assert not t.done()
    with pytest.raises(TimeoutError):
        t.wait_layer(first, timeout=0.05)
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            placed = torch.equal(kv.layer(n, layer)[16:24], want[n][layer][0:8])
            assert placed == (layer < first), (n, layer)
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

    run_threads(worker, 8)
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
    assert mover.staging.num_free == mover.staging.num_slots
    with pytest.raises(kvmove.KVMoveError, match="closed"):
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]))


def test_full_staging_applies_back_pressure_then_raises(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv, staging_slots=2, alloc_timeout=0.2)
    held = mover.staging.alloc(2)
    with pytest.raises(kvmove.StagingFull):  # the first piece: nothing started
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]))
    assert mover.staging.num_free == 0
    threading.Timer(0.1, mover.staging.free, args=(held,)).start()
    mover.alloc_timeout = 10
    assert mover.evict(keyspace(1, "late"), torch.tensor([[0, 1, 2, 3]])).wait(30) == [
        kvmove.Status.OK]


def test_an_evict_that_must_not_wait_for_staging_raises_at_once(make_mover, keyspace,
                                                                monkeypatch):
    """``wait_for_staging=False``: slots that would come free within the mover's
    alloc_timeout are not waited for; the first piece raises, a later piece's keys end
    FAILED (STAGING_TIMEOUT) while the pieces before it are put."""
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv, staging_slots=2, alloc_timeout=30)
    held = mover.staging.alloc(2)
    threading.Timer(0.5, mover.staging.free, args=(held,)).start()
    with pytest.raises(kvmove.StagingFull):
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]), wait_for_staging=False)
    with pytest.raises(TypeError, match="wait_for_staging"):
        mover.evict(keyspace(1), torch.tensor([[0, 1, 2, 3]]), wait_for_staging=0)
    assert mover.evict(keyspace(1, "waits"), torch.tensor([[0, 1, 2, 3]])).wait(30) == [
        kvmove.Status.OK]  # the default waits for the slots freed meanwhile
    # Three keys in pieces of two: the second piece finds the first's slots still held
    # (its put takes a while).
    put_job = mover._evict_path._put_job

    def slow_put(*args):
        time.sleep(0.5)
        return put_job(*args)

    monkeypatch.setattr(mover._evict_path, "_put_job", slow_put)
    t = mover.evict(keyspace(3, "pieces"), torch.arange(12).reshape(3, 4),
                    wait_for_staging=False)
    result = t.result(30)
    assert result.statuses[:2] == [kvmove.Status.OK] * 2
    assert result.statuses[2] is kvmove.Status.FAILED
    assert result.codes[2] == kvmove.status.STAGING_TIMEOUT


def test_calls_larger_than_the_staging_run_in_pieces(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](72))
    want = snapshot(kv)
    mover = make_mover(kv, staging_slots=3)
    keys = keyspace(8)  # three pieces: 3 + 3 + 2
    pages = torch.arange(32).reshape(8, 4)
    t = mover.evict(keys, pages)
    assert t.wait(30) == [kvmove.Status.OK] * 8
    assert mover.staging.num_free == 3
    # Back into other rows, with an unknown key in the middle piece, layer by layer.
    write_random(kv, torch.arange(32, 68), torch.Generator().manual_seed(7))
    after = snapshot(kv)
    asked = [*keys[:4], "never-stored", *keys[4:]]
    dest = torch.arange(32, 68).reshape(9, 4)
    p = mover.prefetch(asked, dest, layerwise=True)
    for layer in range(kv.max_layers):
        p.wait_layer(layer, timeout=30)
    p.scattered.synchronize()
    statuses = p.wait(30)
    assert statuses == [kvmove.Status.OK] * 4 + [kvmove.Status.MISS] + [kvmove.Status.OK] * 4
    assert mover.staging.num_free == 3
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            got, src = kv.layer(name, layer), want[name][layer]
            for i, k in enumerate(asked):
                rows = dest[i]
                if k == "never-stored":  # untouched
                    assert torch.equal(got[rows], after[name][layer][rows])
                else:
                    j = keys.index(k)
                    assert torch.equal(got[rows], src[pages[j]])


def test_a_later_piece_without_slots_fails_its_keys_and_keeps_the_rows(make_mover, keyspace,
                                                                       monkeypatch):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    mover = make_mover(kv, staging_slots=2, alloc_timeout=0.2)
    # The first piece's put holds its slots until the store answers; a store stalled for
    # longer than alloc_timeout leaves the second piece without slots.
    release = threading.Event()
    real_put = mover.store.put

    def stalled_put(desc):
        assert release.wait(30)
        return real_put(desc)

    monkeypatch.setattr(mover.store, "put", stalled_put)
    # the mover's puts go through put
    monkeypatch.setattr(mover.store, "begin_put", plain_begin_put(mover.store))
    try:
        t = mover.evict(keyspace(3), torch.arange(12).reshape(3, 4))
    finally:
        release.set()
    result = t.result(30)
    assert result.statuses == [kvmove.Status.OK] * 2 + [kvmove.Status.FAILED]
    assert result.codes[2] == STAGING_TIMEOUT
    assert mover.staging.num_free == 2


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


def test_unchecked_calls_fail_the_keys_with_bad_rows_and_only_those(make_mover, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](32))
    want = snapshot(kv)
    mover = make_mover(kv, check=False)
    keys = keyspace(3)
    pages = torch.tensor([[0, 1, 2, 3], [4, 5, 99, 7], [8, 9, 10, 11]])  # 99: past 32 slots
    result = mover.evict(keys, pages).result(30)
    assert result.statuses == [kvmove.Status.OK, kvmove.Status.FAILED, kvmove.Status.OK]
    assert result.codes[1] == BAD_ROWS
    assert mover.store.exists(mover.keyspace.store_keys(keys)) == [True, False, True]
    # Prefetch: a key whose destination page has a bad row FAILED, its rows untouched; the
    # others land.
    dest = torch.tensor([[12, 13, 14, 15], [16, 17, 18, 19], [20, -5, 22, 23]])
    got = mover.prefetch([keys[0], keys[2], keys[2] + "-again"], dest[[0, 1, 2]]).result(30)
    assert got.statuses == [kvmove.Status.OK, kvmove.Status.OK, kvmove.Status.MISS]
    bad = mover.prefetch([keys[2]], dest[2:]).result(30)
    assert bad.statuses == [kvmove.Status.FAILED] and bad.codes == [BAD_ROWS]
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            t = kv.layer(n, layer)
            assert torch.equal(t[12:16], want[n][layer][0:4])
            assert torch.equal(t[16:20], want[n][layer][8:12])
            assert torch.equal(t[20:24], want[n][layer][20:24])  # untouched
    assert mover.staging.num_free == mover.staging.num_slots


def test_scattered_marks_the_end_of_a_prefetch_on_the_cpu(make_mover, keyspace, monkeypatch):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    want = snapshot(kv)
    mover = make_mover(kv)
    keys = keyspace(2)
    assert mover.evict(keys, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])).wait(30) == [
        kvmove.Status.OK] * 2
    release = threading.Event()
    real_copy = staged_path.run_pages

    def slow_copy(prepared, *args):
        if prepared.direction == "scatter":
            assert release.wait(30)
        return real_copy(prepared, *args)

    monkeypatch.setattr(staged_path, "run_pages", slow_copy)
    t = mover.prefetch(keys, torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]]))
    assert not t.scattered.query()
    release.set()
    t.scattered.synchronize()
    assert t.scattered.query()
    t.scattered.wait()  # what stream.wait_event(t.scattered) calls
    for layer in range(kv.num_layers("kv")):
        assert torch.equal(kv.layer("kv", layer)[8:16], want["kv"][layer][0:8])
    assert t.wait(30) == [kvmove.Status.OK] * 2


def test_the_mover_copies_index_tensors_at_call_time(make_mover, keyspace, monkeypatch):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    want = snapshot(kv)
    mover = make_mover(kv)
    keys = keyspace(1)
    assert mover.evict(keys, torch.tensor([[0, 1, 2, 3]])).wait(30) == [kvmove.Status.OK]
    release = threading.Event()
    real_get = mover.store.get
    monkeypatch.setattr(mover.store, "get", lambda desc: (release.wait(30), real_get(desc))[1])
    dest = torch.tensor([[8, 9, 10, 11]])
    t = mover.prefetch(keys, dest)
    dest[0] = torch.tensor([16, 17, 18, 19])  # the engine reuses its index buffer at once
    release.set()
    assert t.wait(30) == [kvmove.Status.OK]
    for layer in range(kv.num_layers("kv")):
        assert torch.equal(kv.layer("kv", layer)[8:12], want["kv"][layer][0:4])
        assert torch.equal(kv.layer("kv", layer)[16:20], want["kv"][layer][16:20])


@pytest.mark.parametrize("alloc_timeout", [-1, float("inf"), 1e10, "5", True, float("nan")])
def test_a_bad_alloc_timeout_is_refused_when_the_mover_is_built(store, alloc_timeout):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    with pytest.raises(ValueError, match="alloc_timeout"):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="staged",
                       alloc_timeout=alloc_timeout)


@pytest.mark.parametrize("alloc_timeout", [None, 0, 0.5])
def test_alloc_timeout_none_zero_and_seconds_are_accepted(store, alloc_timeout):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="staged",
                        alloc_timeout=alloc_timeout) as mover:
        assert mover.alloc_timeout == alloc_timeout
