"""``KVMover(path="in_place")`` against ``path="staged"``, on a real embedded master: the same
objects byte for byte (both layouts, MLA / MHA / hybrid caches with padded rows, partial
pages, padding), each path reading the other's; the same statuses (OK, MISS, EXISTS, size
mismatches both ways, bad rows, a holder that died); failed gets leave the rows untouched;
layer-wise prefetch, calls larger than the staging, raw keys, close; the KV memory is
registered while the mover lives (the choice of path: ``test_path_choice.py``)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.cli.cluster_node import ClusterNode, NodeProcess
from kvmove.memory.host_memory import HostMemory
from kvmove.mover import kv_mover as mover_module
from kvmove.status import BAD_ROWS
from tests.support.caches import GEOMETRIES, snapshot
from tests.support.store_state import (
    CHECK,
    GET,
    PUT,
    SlowClient,
    registered_regions,
    swap_client,
)
from tests.support.threads import close_while_calling

PATHS = ("staged", "in_place")


@pytest.fixture
def movers(store):
    """``movers(kv, **kwargs)``: a staged and an in-place mover on ``kv``, closed after the
    test (their staging back to full)."""
    made = []

    def make(kv, **kwargs):
        kwargs.setdefault("page_tokens", 4)
        kwargs.setdefault("staging_slots", 8)
        pair = {p: kvmove.KVMover(kv, store, path=p, **kwargs) for p in PATHS}
        made.extend(pair.values())
        return pair

    yield make
    for m in made:
        m.close()
        assert m.staging.num_free == m.staging.num_slots


def read_objects(store, store_keys: list[str], sizes: list[int]) -> list[bytes]:
    """The stored objects, read raw into host memory (one span each)."""
    memory = HostMemory(sum(sizes), pin=None)
    try:
        at, ptrs = memory.address, []
        for n in sizes:
            ptrs.append([at])
            at += n
        desc = kvmove.Descriptors(store_keys, ptrs, [[n] for n in sizes],
                                  regions=[(memory.address, memory.nbytes)])
        assert store.get(desc) == [Status.OK] * len(store_keys)
        raw = memory.tensor.numpy().tobytes()
        out, at = [], 0
        for n in sizes:
            out.append(raw[at:at + n])
            at += n
        return out
    finally:
        store.unregister([(memory.address, memory.nbytes)])
        memory.close()


def rows_bytes(kv, rows: torch.Tensor) -> bytes:
    rows = rows[rows >= 0]
    return b"".join(kv.layer(n, layer)[rows].contiguous().view(torch.uint8).numpy().tobytes()
                    for n in kv.buffer_names for layer in range(kv.num_layers(n)))


def scribble(kv, rows: torch.Tensor) -> None:
    rows = rows[rows >= 0]
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            kv.layer(n, layer).view(torch.uint8)[rows] = 0x5A


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_both_paths_store_the_same_objects_and_read_each_others(movers, store, keyspace,
                                                                 geometry, layout):
    kv = kvmove.KVCache(GEOMETRIES[geometry](96))
    pair = movers(kv, layout=layout)
    src = torch.tensor([[0, 1, 2, 3], [9, 5, 30, 7], [10, 11, -1, 13], [40, 41, 42, -1]])
    valid = [4, 4, 4, 3]  # a hole inside the valid rows, and a partial page
    keys = {p: keyspace(4, tag=p) for p in PATHS}
    # Every staging slot holds other pages first: the hole must not carry them.
    dirt = torch.arange(48, 80).reshape(8, 4)
    assert pair["staged"].evict(keyspace(8, tag="dirt"), dirt).wait(30) == [Status.OK] * 8
    for p, m in pair.items():
        assert m.evict(keys[p], src, valid_tokens=valid).wait(30) == [Status.OK] * 4
    sizes = [kvmove.StagingBuffer(kv, num_slots=1, page_tokens=4).object_bytes] * 3
    sizes.append(sizes[0] // 4 * 3)
    objects = {p: read_objects(store, pair[p].keyspace.store_keys(keys[p]), sizes)
               for p in PATHS}
    assert objects["staged"] == objects["in_place"]
    # Each path reads the other's objects into other rows: the same rows land.
    want = [rows_bytes(kv, page[: v]) for page, v in zip(src, valid, strict=True)]
    dst = {"staged": torch.arange(48, 64).reshape(4, 4),
           "in_place": torch.arange(64, 80).reshape(4, 4)}
    for reader, writer in (("staged", "in_place"), ("in_place", "staged")):
        d = dst[reader].clone()
        d[2, 2] = -1  # a row the prefetch leaves alone
        untouched = rows_bytes(kv, dst[reader][2, 2:3])
        scribble(kv, d[3, 3:])  # past the short page's valid rows: left alone too
        past_valid = rows_bytes(kv, d[3, 3:])
        got = pair[reader].prefetch(keys[writer], d, valid_tokens=valid).wait(30)
        assert got == [Status.OK] * 4
        assert rows_bytes(kv, d[3, 3:]) == past_valid, reader
        for i, v in enumerate(valid):
            page = d[i, :v]
            if i == 2:  # without the hole
                assert rows_bytes(kv, page) == rows_bytes(kv, src[i, :v][src[i, :v] >= 0])
                assert rows_bytes(kv, dst[reader][2, 2:3]) == untouched
            else:
                assert rows_bytes(kv, page) == want[i]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_numpy_pages_move_as_tensors_do_and_are_copied_at_call_time(movers, keyspace, dtype):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](96))
    pair = movers(kv)
    src = torch.tensor([[0, 1, 2, 3], [9, 5, 30, 7], [40, 41, 42, 43]])
    want = [rows_bytes(kv, page) for page in src]
    for p, m in pair.items():
        keys = keyspace(3, tag=p)
        assert m.evict(keys, src.numpy().astype(dtype)).wait(30) == [Status.OK] * 3
        dst = np.arange(48 + 16 * PATHS.index(p), 60 + 16 * PATHS.index(p),
                        dtype=dtype).reshape(3, 4)
        asked = dst.copy()
        t = m.prefetch(keys, dst)
        dst[:] = 90  # the caller reuses its array at once: the call took its own copy
        assert t.wait(30) == [Status.OK] * 3, p
        got = [rows_bytes(kv, torch.from_numpy(page.astype(np.int64))) for page in asked]
        assert got == want, p
        for bad, error, match in ((dst.astype(np.float32), TypeError, "token_pages must be "
                                   "int32 or int64"),
                                  (dst.reshape(-1), ValueError, "token_pages must have 2 "
                                   "dimension"),
                                  (np.full((3, 4), 96, dtype=dtype), IndexError,
                                   r"token_pages\[0\] = 96 is out of range"),
                                  (np.zeros((3, 4), dtype=dtype), ValueError, "more than once")):
            with pytest.raises(error, match=match):
                m.prefetch(keyspace(3, tag="bad"), bad)


def test_both_paths_give_the_same_statuses_and_leave_failed_rows_untouched(movers, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](128))
    pair = movers(kv, check=False)
    pages = torch.arange(16).reshape(4, 4)
    results = {}
    for p, m in pair.items():
        k = keyspace(6, tag=p)
        first = m.evict([k[0], k[1], k[5]], pages[:3]).result(30)
        # EXISTS, an out-of-range row (not stored), a short page
        second = m.evict([k[1], k[2], k[3]], torch.tensor([[4, 5, 6, 7], [8, 9, 999, 11],
                                                           [12, 13, 14, 15]]),
                         valid_tokens=[4, 4, 2]).result(30)
        dest = torch.arange(64 + 32 * PATHS.index(p), 64 + 32 * PATHS.index(p) + 28)
        dest = dest.reshape(7, 4)
        asked = [k[0], k[4], k[3], k[0] + "x", k[1], k[1] + "y", k[5]]
        dest[5, 3] = 1000  # out of range, for a key that does not exist: MISS on both
        dest[6, 0] = 1001  # out of range, for a stored key: FAILED (BAD_ROWS) on both
        scribble(kv, dest.reshape(-1)[dest.reshape(-1) < 128])
        before = snapshot(kv)
        got = m.prefetch(asked, dest, valid_tokens=[4, 4, 4, 4, 2, 4, 4]).result(30)
        results[p] = (first.statuses, second.statuses, second.codes[1], got.statuses,
                      got.codes[-1])
        after = snapshot(kv)
        for i, st in enumerate(got.statuses):
            rows = dest[i][(dest[i] >= 0) & (dest[i] < 128)]
            for n in kv.buffer_names:
                for layer in range(kv.num_layers(n)):
                    if st is not Status.OK:  # untouched
                        assert torch.equal(after[n][layer][rows], before[n][layer][rows]), \
                            (p, i, st)
    assert results["staged"] == results["in_place"]
    first, second, bad_code, got, got_bad = results["in_place"]
    assert first == [Status.OK] * 3
    assert second == [Status.EXISTS, Status.FAILED, Status.OK] and bad_code == BAD_ROWS
    assert got == [Status.OK, Status.MISS, Status.SIZE_MISMATCH, Status.MISS,
                   Status.SIZE_MISMATCH, Status.MISS, Status.FAILED]
    assert got_bad == BAD_ROWS


@pytest.mark.parametrize("path", PATHS)
def test_an_evict_without_the_exists_query(movers, store, keyspace, path):
    """``detect_exists=False``: puts only, no exists query first (every piece of an evict
    larger than the staging too); a stored key ends OK (as Mooncake answers) and keeps its
    first object. The store's default still asks."""
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](128))
    m = movers(kv)[path]  # 8 staging slots: 10 keys are two staged pieces
    client = swap_client(store, SlowClient)
    first, second = torch.arange(40).reshape(10, 4), torch.arange(40, 80).reshape(10, 4)
    scribble(kv, first.reshape(-1))
    keys = keyspace(10)
    puts = [PUT, PUT] if path == "staged" else [PUT]
    assert m.evict(keys, first, detect_exists=False).wait(30) == [Status.OK] * 10
    assert client.names() == puts
    client.calls.clear()
    # the same keys from other rows: OK without the query, EXISTS with it; the first kept
    assert m.evict(keys, second, detect_exists=False).wait(30) == [Status.OK] * 10
    assert client.names() == puts
    client.calls.clear()
    assert m.evict(keys, second).wait(30) == [Status.EXISTS] * 10
    assert CHECK in client.names()
    dest = torch.arange(80, 120).reshape(10, 4)
    assert m.prefetch(keys, dest).wait(30) == [Status.OK] * 10
    assert rows_bytes(kv, dest.reshape(-1)) == rows_bytes(kv, first.reshape(-1))


def test_detect_exists_is_checked_before_anything_moves(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](16))
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place") as m, \
            pytest.raises(TypeError, match="detect_exists must be None or a bool, got 0"):
        m.evict(keyspace(1), torch.arange(4).reshape(1, 4), detect_exists=0)


def test_a_holder_gone_before_the_get_fails_both_paths_and_writes_nothing(tmp_path):
    # Every object lives in another process's segment; that process is SIGKILLed; readers
    # of both paths (this process, no segment of their own) get FAILED or MISS, rows intact.
    with kvmove.EmbeddedMaster() as master:
        holder = NodeProcess(master.address, log_path=tmp_path / "holder.log", layers=2,
                             page_tokens=4, resident=16, key_prefix="gone")
        config = kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1",
                                    global_segment_size=0)
        store = kvmove.MooncakeStore(config)
        readers = {p: ClusterNode(store, layers=2, page_tokens=4, resident=16,
                                  key_prefix="gone", path=p) for p in PATHS}
        try:
            pages = list(range(12))
            assert holder.call("evict", pages=pages)["statuses"] == ["ok"] * 12
            for reader in readers.values():
                assert reader.prefetch(pages)["statuses"] == ["ok"] * 12
            holder.kill()
            for p, reader in readers.items():
                got = reader.prefetch(pages)
                assert set(got["statuses"]) <= {"failed", "miss"}, (p, Counter(got["statuses"]))
                assert got["touched"] == [] and got["wrong"] == [], p
        finally:
            for reader in readers.values():
                reader.mover.close()
            store.close()
            holder.close()


def test_layerwise_prefetch_in_place_lands_every_layer(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["hybrid"](64))
    want = snapshot(kv)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place") as m:
        keys = keyspace(3)
        assert m.evict(keys, torch.arange(12).reshape(3, 4)).wait(30) == [Status.OK] * 3
        t = m.prefetch(keys, torch.arange(32, 44).reshape(3, 4), layerwise=True)
        for layer in range(kv.max_layers):
            t.wait_layer(layer, timeout=30)
        t.scattered.synchronize()
        assert t.scattered.query()
        assert t.wait(30) == [Status.OK] * 3
        for n in kv.buffer_names:
            for layer in range(kv.num_layers(n)):
                assert torch.equal(kv.layer(n, layer)[32:44], want[n][layer][0:12])


def test_in_place_calls_larger_than_the_staging_with_raw_keys(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](128))
    want = snapshot(kv)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=2, path="in_place",
                        raw_keys=True) as m:
        assert m.staging.num_slots == 1  # no staging to speak of
        keys = keyspace(12)
        assert m.evict(keys, torch.arange(48).reshape(12, 4)).wait(30) == [Status.OK] * 12
        assert store.exists(keys) == [True] * 12  # raw: the keys as given
        assert m.prefetch(keys, torch.arange(64, 112).reshape(12, 4)).wait(30) == [
            Status.OK] * 12
        for layer in range(4):
            assert torch.equal(kv.layer("kv", layer)[64:112], want["kv"][layer][0:48])
        stats = m.stats()
        assert stats.pages_put == 12 and stats.pages_got == 12 and stats.gather_s == 0


def test_in_place_evict_returns_once_the_rows_are_read(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place") as m:
        keys = keyspace(2)
        src = torch.arange(8).reshape(2, 4)
        want = rows_bytes(kv, src.reshape(-1))
        t = m.evict(keys, src)
        assert t.done() and t.gathered.query()
        scribble(kv, src.reshape(-1))  # the engine reuses the rows at once
        assert t.wait(0) == [Status.OK] * 2
        assert m.prefetch(keys, torch.arange(16, 24).reshape(2, 4)).wait(30) == [Status.OK] * 2
        assert rows_bytes(kv, torch.arange(16, 24)) == want


def test_an_in_place_put_in_the_background_returns_at_once(store, keyspace, monkeypatch):
    """``put_in_background=True`` on the CPU: evict returns with the put still running (here
    stalled) and ``gathered`` completes once the store has read the rows; the object holds
    the rows as they were at the call."""
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    with pytest.raises(TypeError, match="put_in_background"):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, put_in_background=1)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place",
                        put_in_background=True) as m:
        keys = keyspace(2)
        src = torch.arange(8).reshape(2, 4)
        want = rows_bytes(kv, src.reshape(-1))
        release = threading.Event()
        real_put = store.put

        def stalled_put(desc, **kwargs):
            assert release.wait(30)
            return real_put(desc, **kwargs)

        monkeypatch.setattr(store, "put", stalled_put)  # in place, the put is made at once
        t = m.evict(keys, src)
        assert not t.done() and not t.gathered.query()
        release.set()
        t.gathered.synchronize()
        scribble(kv, src.reshape(-1))  # the engine takes the rows back once they are read
        assert t.wait(30) == [Status.OK] * 2
        assert m.prefetch(keys, torch.arange(16, 24).reshape(2, 4)).wait(30) == [Status.OK] * 2
        assert rows_bytes(kv, torch.arange(16, 24)) == want


def test_the_kv_memory_is_registered_while_the_mover_lives(store, keyspace):
    kv = kvmove.KVCache(GEOMETRIES["mha"](32))
    m = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place")
    regions = m._rows.regions()
    assert len(m._rows.kv_regions) == 6  # six per-layer tensors
    assert set(regions) <= set(registered_regions(store))
    m.close()
    assert not set(regions) & set(registered_regions(store))


def test_close_waits_for_in_place_evicts_running_on_callers_threads(store, keyspace,
                                                                     caplog):
    kv = kvmove.KVCache(GEOMETRIES["mla"](256))
    m = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place")
    regions = m._rows.regions()

    def evict(w: int, i: int) -> str:
        return m.evict(keyspace(1, tag=f"{w}-{i}"),
                       torch.arange(w * 16, w * 16 + 4).reshape(1, 4)).wait(30)[0].value

    with caplog.at_level("WARNING", logger="kvmove"):
        outcomes = close_while_calling(evict, m.close)
    assert outcomes["refused"] > 0 and outcomes["ok"] > 0, outcomes
    assert not [r for r in caplog.records if "unregister" in r.getMessage()]
    assert not set(regions) & set(registered_regions(store))


@pytest.mark.parametrize("bad", [{"raw_keys": True, "key_prefix": "x"}, {"key_prefix": "a\n"},
                                 {"key_prefix": "a b"}, {"backend": "cuda"}])
def test_a_bad_argument_raises_before_the_kv_memory_is_registered(store, bad):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    before = set(registered_regions(store))
    with pytest.raises((ValueError, TypeError)):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place", **bad)
    assert set(registered_regions(store)) == before


def test_a_mover_that_fails_to_build_unregisters_the_kv_memory(store, monkeypatch):
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    before = set(registered_regions(store))

    def no_staging(*args, **kwargs):
        raise MemoryError("no pinned memory left")

    monkeypatch.setattr(mover_module, "StagingBuffer", no_staging)
    with pytest.raises(MemoryError):
        kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place")
    assert set(registered_regions(store)) == before
    monkeypatch.undo()
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="in_place") as m:
        assert m.path == "in_place"  # the same memory registers again


@pytest.fixture
def slow_calls(store, monkeypatch):
    """A second store on the master (one key per Mooncake call; calls given up at 0.5 s)
    and its :class:`SlowClient` (``delay[PUT] = 1.5`` makes its puts outlast that). Its
    client is kept after a call given up: these tests are about the call, not about the
    replacement that follows it (``tests/store/test_client_replacement.py``), whose new
    client's first call may outlast 0.5 s here."""
    config = kvmove.StoreConfig(master_address=store.address, max_batch_keys=1,
                                call_timeout=0.5, global_segment_size=0)
    s = kvmove.MooncakeStore(config)
    client = swap_client(s, SlowClient)
    monkeypatch.setattr(s, "_replace_client", lambda old: None)
    yield s, client
    s.close()


def returned(store) -> None:
    """Wait for the store's calls given up to return (and their callbacks to run)."""
    deadline = time.monotonic() + 10
    while store._state.late and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store._state.late
    time.sleep(0.3)  # the removal runs in the late call's callback


def test_a_put_given_up_removes_only_what_it_stored(slow_calls, keyspace):
    # Keys are content hashes: an evict of keys stored earlier is common. A put given up
    # removes, once it returns, the keys it stored (their bytes may be of two moments), not
    # a key it never tried (an object stored earlier, good, stays).
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    new, old = keyspace(2)
    pages = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place") as m:
        assert m.evict([old], pages[1:]).wait() == [Status.OK]
        client.delay[PUT] = 1.5
        result = m.evict([new, old], pages).result()  # new's call given up, old's not tried
        assert result.statuses == [Status.FAILED] * 2
        assert result.codes == [kvmove.status.CALL_TIMEOUT] * 2
        client.delay.clear()
        returned(s)
        dest = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]])
        assert m.prefetch([new, old], dest).wait() == [Status.MISS, Status.OK]
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                assert torch.equal(kv.layer(name, layer)[12:16], kv.layer(name, layer)[4:8])


def test_a_put_given_up_without_the_exists_query_removes_a_key_stored_before(slow_calls,
                                                                            keyspace):
    # Without the query Mooncake answers 0 for a stored key: the late call reads as having
    # stored it, and its keys are removed once it returns (a later MISS, never bytes of two
    # moments), the object stored before included (KVMover.evict's docstring).
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    keys = keyspace(1)
    page = torch.tensor([[0, 1, 2, 3]])
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place") as m:
        assert m.evict(keys, page).wait() == [Status.OK]
        client.delay[PUT] = 1.5
        assert m.evict(keys, page, detect_exists=False).wait() == [Status.FAILED]
        assert client.names()[-1] == PUT and CHECK not in client.names()[1:]
        client.delay.clear()
        returned(s)
        assert s.exists(m.keyspace.store_keys(keys)) == [False]


def test_a_key_whose_put_was_given_up_is_not_put_again_until_that_call_returns(slow_calls,
                                                                              keyspace):
    # The late call stores the key (bytes of a moment the engine may have written over) and
    # is then removed: a retry meanwhile would be reported stored, then removed. It ends
    # FAILED instead; once the late call has returned, a retry stores the key for good.
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    keys = keyspace(1)
    page = torch.tensor([[0, 1, 2, 3]])
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place") as m:
        client.delay[PUT] = 1.5
        assert m.evict(keys, page).wait() == [Status.FAILED]
        client.delay.clear()
        retry = m.evict(keys, page).result()
        assert retry.statuses == [Status.FAILED]
        assert retry.codes == [kvmove.status.CALL_TIMEOUT]
        returned(s)
        assert not m._life.held_keys
        assert s.exists(m.keyspace.store_keys(keys)) == [False]  # the late object is removed
        assert m.evict(keys, page).wait() == [Status.OK]
        assert m.prefetch(keys, torch.tensor([[8, 9, 10, 11]])).wait() == [Status.OK]


def test_close_keeps_the_kv_rows_registered_until_a_put_given_up_returns(slow_calls,
                                                                        keyspace):
    # Mooncake reads the KV rows (and the zero row of padding) until a given-up put really
    # returns: close() leaves them registered and allocated until then, then releases them.
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    m = kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place")
    regions = set(m._rows.regions())
    closed = []
    real_close = m._rows.close
    m._rows.close = lambda: (closed.append(True), real_close())
    client.delay[PUT] = 1.5
    assert m.evict(keyspace(1), torch.tensor([[0, 1, -1, 3]])).wait() == [Status.FAILED]
    client.delay.clear()
    m.close()
    assert regions <= set(registered_regions(s))  # still read by the call given up
    assert closed == []  # the zero row it reads is still allocated
    returned(s)
    assert not regions & set(registered_regions(s))
    assert closed == [True]


def test_an_in_place_get_runs_on_the_jobs_thread_and_ends_when_mooncake_returns(slow_calls,
                                                                             keyspace):
    # The rows of an in-place get go back to the engine only once Mooncake has let go of
    # them, so a get on the mover's worker runs on that thread (no hand-off to the store's
    # runner), still given up at the store's bound: its keys FAILED (CALL_TIMEOUT), and the
    # prefetch ends when the call returned. A job its caller runs in an unbounded wait
    # (the main thread included) runs the get on that thread, with no hand-off either.
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    keys = keyspace(2)
    src, dst = torch.arange(0, 8).reshape(2, 4), torch.arange(16, 24).reshape(2, 4)
    main = threading.get_ident()
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place") as m:
        assert m.evict(keys, src).wait() == [Status.OK] * 2
        assert m.prefetch(keys, dst).wait(30) == [Status.OK] * 2  # bounded: the worker's
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                assert torch.equal(kv.layer(name, layer)[16:24], kv.layer(name, layer)[0:8])
        runners = {t.ident for t in threading.enumerate() if t.name == "kvmove-call"}
        assert len(client.threads(GET)) == 2  # one key per call
        assert not set(client.threads(GET)) & (runners | {main})
        assert m.prefetch(keys, dst).wait() == [Status.OK] * 2  # on a worker or here
        assert not set(client.threads(GET)[2:]) & runners
        workers = {t.ident for t in threading.enumerate() if t.name.startswith("kvmove_")}
        assert set(client.threads(GET)[2:]) <= workers | {main}
        client.delay[GET] = 1.5
        t0 = time.monotonic()
        result = m.prefetch(keys, dst).result(30)
        assert time.monotonic() - t0 >= 1.5
        assert result.statuses == [Status.FAILED] * 2
        assert result.codes == [kvmove.status.CALL_TIMEOUT] * 2  # the second: not tried
        assert len(client.threads(GET)) == 5
        assert not set(client.threads(GET)[-1:]) & (runners | {main})


def test_an_in_place_put_in_the_background_runs_on_its_worker_and_ends_when_mooncake_returns(
        slow_calls, keyspace):
    # A put in the background (the engine holds the rows until it ends) runs on the mover's
    # put worker, with no hand-off to the store's runner; a put given up at the store's bound
    # ends FAILED (CALL_TIMEOUT) once Mooncake has returned (no row is read after it), and
    # what it stored late is removed then. An evict that puts on the caller's thread (any
    # thread) hands the put off as before, and so keeps the bound.
    s, client = slow_calls
    kv = kvmove.KVCache(GEOMETRIES["mla"](32))
    keys, late = keyspace(2), keyspace(1, tag="late")
    src = torch.arange(0, 8).reshape(2, 4)
    main = threading.get_ident()
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place",
                        put_in_background=True) as m:
        assert m.evict(keys, src).wait(30) == [Status.OK] * 2
        runners = {t.ident for t in threading.enumerate() if t.name == "kvmove-call"}
        assert len(client.threads(PUT)) == 2  # one key per call
        assert not set(client.threads(PUT)) & (runners | {main})
        client.delay[PUT] = 1.5
        t0 = time.monotonic()
        result = m.evict(late, src[:1]).result(30)
        assert time.monotonic() - t0 >= 1.5  # ended once the put returned, not at 0.5 s
        assert result.statuses == [Status.FAILED]
        assert result.codes == [kvmove.status.CALL_TIMEOUT]
        assert not set(client.threads(PUT)[-1:]) & (runners | {main})
        client.delay.clear()
        time.sleep(0.3)  # the removal runs in the late call's callback
        assert m.prefetch(late, torch.arange(16, 20).reshape(1, 4)).wait(30) == [Status.MISS]
    with kvmove.KVMover(kv, s, page_tokens=4, staging_slots=4, path="in_place") as m:
        assert m.evict(keyspace(1, tag="inline"), src[1:]).wait(30) == [Status.OK]
        assert client.threads(PUT)[-1] in runners  # on the main thread: handed off
        got = []
        caller = threading.Thread(target=lambda: got.append(
            m.evict(keyspace(1, tag="thread"), src[1:]).wait(30)))
        caller.start()
        caller.join()
        assert got == [[Status.OK]]
        assert client.threads(PUT)[-1] in runners  # on another caller's thread: the same
