"""MooncakeStore against a real embedded mooncake_master: every status produced for real,
bytes checked, nothing mocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.store.mooncake_store import StoreResult
from tests.conftest import LEASE_MS
from tests.support.staging_data import GEOMETRIES, canonical, make_staging, page
from tests.support.store_state import registered_regions
from tests.support.threads import run_threads

pytestmark = pytest.mark.store
ROOT = Path(__file__).resolve().parent.parent.parent


def _zero_slots(staging, slots):
    for name in staging.buffer_names:
        staging.tensor(name)[:, slots] = 0


def _assert_page_equal(staging, dst, src, valid_tokens):
    """Slot ``dst`` holds slot ``src``'s first ``valid_tokens`` rows of every layer and
    zeros after them (the get wrote exactly the object, nothing more)."""
    for name in staging.buffer_names:
        t, n = staging.tensor(name), valid_tokens * staging.row_bytes(name)
        assert torch.equal(t[:, dst, :n], t[:, src, :n]), f"buffer {name!r} differs"
        assert not t[:, dst, n:].any(), f"buffer {name!r}: bytes past the object were written"


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("valid_tokens", [None, [16, 1, 9]])
def test_round_trip(store, keyspace, geometry, valid_tokens):
    staging = make_staging(GEOMETRIES[geometry], num_slots=6, page_tokens=16, seed=7)
    keys = keyspace(3)
    put = store.put(kvmove.describe(staging, [0, 1, 2], keys, valid_tokens=valid_tokens))
    assert put == [Status.OK] * 3 and put.codes == [0, 0, 0]
    _zero_slots(staging, [3, 4, 5])
    desc = kvmove.describe(staging, [5, 3, 4], keys, valid_tokens=valid_tokens)
    got = store.get(desc)
    assert got == [Status.OK] * 3
    assert got.codes == desc.object_sizes()
    vts = valid_tokens or [16] * 3
    for dst, src, vt in zip([5, 3, 4], [0, 1, 2], vts, strict=True):
        _assert_page_equal(staging, dst, src, vt)


@pytest.mark.parametrize("n", [1, 5000])
def test_round_trip_many_keys(store, keyspace, n):
    # 5000 keys span several max_batch_keys chunks (1024 by default).
    staging = make_staging({"kv": (2, 656)}, num_slots=2 * n, page_tokens=2, seed=n)
    keys = keyspace(n)
    src, dst = torch.arange(n), torch.arange(n, 2 * n).flip(0)
    assert store.put(kvmove.describe(staging, src, keys)).all_ok
    _zero_slots(staging, dst)
    got = store.get(kvmove.describe(staging, dst, keys))
    assert got.all_ok and len(got) == n
    t = staging.tensor("kv")
    assert torch.equal(t[:, dst], t[:, src])


def test_put_of_existing_key_reports_exists_and_keeps_first_object(store, keyspace):
    staging = make_staging(GEOMETRIES["mha"], num_slots=4, page_tokens=4, seed=8)
    keys = keyspace(2)
    first = canonical(staging, 0, 4)
    assert store.put(kvmove.describe(staging, [0], keys[:1])).all_ok
    staging.tensor("k")[:, 0] ^= 0xFF  # new content under the same key
    again = store.put(kvmove.describe(staging, [0, 1], keys))
    assert list(again) == [Status.EXISTS, Status.OK]
    assert again.codes[0] == -705
    _zero_slots(staging, [2])
    assert store.get(kvmove.describe(staging, [2], keys[:1])).all_ok
    assert canonical(staging, 2, 4) == first


def test_get_of_missing_key_is_miss_and_leaves_destination(store, keyspace):
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=3, page_tokens=4, seed=9)
    keys = keyspace(3)
    assert store.put(kvmove.describe(staging, [0], keys[1:2])).all_ok
    before = [page(staging, 1), page(staging, 2)]
    got = store.get(kvmove.describe(staging, [1, 0, 2], [keys[0], keys[1], keys[2]]))
    assert list(got) == [Status.MISS, Status.OK, Status.MISS]
    assert got.codes[0] == got.codes[2] == -704
    for slot, snap in zip([1, 2], before, strict=True):
        for name, t in snap.items():
            assert torch.equal(staging.tensor(name)[:, slot], t)


def test_get_with_other_size_is_size_mismatch_and_leaves_destination(store, keyspace):
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=8, seed=10)
    keys = keyspace(2)
    # key 0 stored as a full page, key 1 as a partial one
    assert store.put(kvmove.describe(staging, [0, 1], keys, valid_tokens=[8, 4])).all_ok
    before = [page(staging, 2), page(staging, 3)]
    # destination smaller than key 0's object (Mooncake -600), larger than key 1's (-800)
    got = store.get(kvmove.describe(staging, [2, 3], keys, valid_tokens=[4, 8]))
    assert list(got) == [Status.SIZE_MISMATCH, Status.SIZE_MISMATCH]
    assert got.codes == [-600, -800]
    for slot, snap in zip([2, 3], before, strict=True):
        assert torch.equal(staging.tensor("kv")[:, slot], snap["kv"])


def test_get_with_other_geometry_is_size_mismatch(store, keyspace):
    mla = make_staging(GEOMETRIES["mla"], num_slots=1, page_tokens=8, seed=11)
    hybrid = make_staging(GEOMETRIES["hybrid"], num_slots=1, page_tokens=8, seed=12)
    keys = keyspace(1)
    assert store.put(kvmove.describe(mla, [0], keys)).all_ok
    before = page(hybrid, 0)
    got = store.get(kvmove.describe(hybrid, [0], keys))
    assert list(got) == [Status.SIZE_MISMATCH]
    for name, t in before.items():
        assert torch.equal(hybrid.tensor(name)[:, 0], t)


def test_no_space_in_a_tiny_store(keyspace):
    # Mooncake's smallest segment is 16 MiB; one 20.5 MiB object cannot fit.
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb") as tiny:
        big = make_staging({"kv": (80, 4100)}, num_slots=1, page_tokens=64)
        small = make_staging({"kv": (1, 656)}, num_slots=1, page_tokens=4)
        keys = keyspace(2)
        assert list(tiny.put(kvmove.describe(big, [0], keys[:1]))) == [Status.NO_SPACE]
        assert tiny.put(kvmove.describe(small, [0], keys[1:])).all_ok
        assert list(tiny.exists(keys)) == [False, True]


def test_exists_and_remove_with_lease(store, keyspace):
    staging = make_staging(GEOMETRIES["mla"], num_slots=2, page_tokens=2, seed=13)
    keys = keyspace(4)
    assert store.put(kvmove.describe(staging, [0, 1], keys[:2])).all_ok
    assert store.get(kvmove.describe(staging, [0], keys[:1])).all_ok  # leases key 0
    removed = store.remove(keys[:3])
    assert list(removed) == [Status.FAILED, Status.OK, Status.MISS]
    assert removed.codes == [-706, 0, -704]
    assert list(store.exists(keys[:3])) == [True, False, False]
    assert list(store.remove(keys[:1], force=True)) == [Status.OK]
    assert not store.exists(keys[:1])[0]
    # Mooncake leases a key to any reader, exists() included
    assert store.put(kvmove.describe(staging, [1], keys[3:])).all_ok
    assert store.exists(keys[3:]).codes == [1]
    assert store.remove(keys[3:]).codes == [-706]


def test_remove_after_lease_expires(store, keyspace):
    staging = make_staging(GEOMETRIES["mla"], num_slots=1, page_tokens=2, seed=14)
    keys = keyspace(1)
    assert store.put(kvmove.describe(staging, [0], keys)).all_ok
    assert store.get(kvmove.describe(staging, [0], keys)).all_ok
    assert list(store.remove(keys)) == [Status.FAILED]
    time.sleep(LEASE_MS / 1000 + 0.3)
    assert list(store.remove(keys)) == [Status.OK]


def test_register_is_idempotent(store):
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=2, page_tokens=2)
    regions = staging.regions()
    store.register(staging)
    store.register(staging)
    registered = registered_regions(store)
    assert all(registered.count(r) == 1 for r in regions)
    store.unregister(staging)
    assert not set(regions) & set(registered_regions(store))


def test_put_and_get_register_descriptor_regions(store, keyspace):
    staging = make_staging(GEOMETRIES["mla"], num_slots=2, page_tokens=2)
    assert store.put(kvmove.describe(staging, [0], keyspace(1))).all_ok
    assert set(staging.regions()) <= set(registered_regions(store))
    store.unregister(staging)


def test_concurrent_puts_and_gets(store, keyspace):
    staging = make_staging(GEOMETRIES["mha"], num_slots=64, page_tokens=4, seed=15)
    keys = keyspace(32)
    errors = []

    def worker(w):
        try:
            mine = keys[w * 8:(w + 1) * 8]
            src = list(range(w * 8, w * 8 + 8))
            dst = [32 + s for s in src]
            assert store.put(kvmove.describe(staging, src, mine)).all_ok
            assert store.get(kvmove.describe(staging, dst, mine)).all_ok
            for name in staging.buffer_names:
                t = staging.tensor(name)
                assert torch.equal(t[:, dst], t[:, src])
        except Exception as e:  # reported below
            errors.append(e)

    run_threads(worker, 4)
    assert not errors


def test_chunking_keeps_key_order(keyspace):
    with kvmove.MooncakeStore.embedded(max_batch_keys=3, global_segment_size="16mb") as s:
        staging = make_staging({"kv": (1, 64)}, num_slots=20, page_tokens=1, seed=16)
        keys = keyspace(10)
        assert s.put(kvmove.describe(staging, range(5), keys[:5])).all_ok
        put = s.put(kvmove.describe(staging, range(10), keys))
        assert list(put) == [Status.EXISTS] * 5 + [Status.OK] * 5
        desc = kvmove.describe(staging, range(10, 20), keys[::-1])
        assert s.get(desc).all_ok
        t = staging.tensor("kv")
        assert torch.equal(t[:, 10:20], t[:, 0:10].flip(1))


def test_result_of_wrong_length_is_an_error(store):
    # The guard around every Mooncake batch call, exercised with a plain function.
    with pytest.raises(kvmove.StoreError, match="answered 1 results for 2 keys"):
        store._batch(lambda keys: [0], ["a", "b"])

    def raises(keys):
        raise RuntimeError("connection reset")

    assert store._batch(raises, ["a", "b"]) == [-1, -1]


def test_unreachable_master_raises_store_error_quickly():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(kvmove.StoreError, match=f"127.0.0.1:{port}"):
        kvmove.MooncakeStore({"master_address": f"127.0.0.1:{port}", "connect_timeout": 1})
    assert time.monotonic() - t0 < 5


def test_master_death_fails_keys_and_close_is_bounded(keyspace):
    s = kvmove.MooncakeStore.embedded(global_segment_size="16mb", max_batch_keys=2)
    staging = make_staging(GEOMETRIES["mla"], num_slots=8, page_tokens=2, seed=17)
    keys = keyspace(8)
    assert s.put(kvmove.describe(staging, [0, 1], keys[:2])).all_ok
    os.kill(s.master.pid, signal.SIGKILL)
    while s.master.running:
        time.sleep(0.01)
    t0 = time.monotonic()
    # 3 chunks each: the first all-RPC_FAIL chunk ends the batch (a call waits ~4 s for
    # Mooncake's reconnect), so the time does not grow with the number of chunks
    put = s.put(kvmove.describe(staging, range(2, 8), keys[2:]))
    got = s.get(kvmove.describe(staging, range(2, 8), keys[:6]))
    assert time.monotonic() - t0 < 12
    assert list(put) == list(got) == [Status.FAILED] * 6
    assert put.codes == got.codes == [-900] * 6
    t0 = time.monotonic()
    s.close()  # restarts the dead embedded master so that the client can close quickly
    assert time.monotonic() - t0 < 8
    assert not s.master.running
    with pytest.raises(kvmove.StoreError, match="closed"):
        s.put(kvmove.describe(staging, [1], keys[1:2]))
    s.close()  # idempotent


def test_store_result_is_a_list_with_codes():
    r = StoreResult([Status.OK, Status.MISS], [10, -704])
    assert r == [Status.OK, Status.MISS] and r.codes == [10, -704]
    assert not r.all_ok and r.summary() == {"ok": 1, "miss": 1}


def test_bad_arguments(store):
    with pytest.raises(TypeError, match=r"kvmove\.Descriptors"):
        store.put([("a", [1], [1])])
    with pytest.raises(TypeError, match="keys must be a sequence of str"):
        store.exists("abc")
    with pytest.raises(ValueError, match="empty string"):
        store.remove([""])
    with pytest.raises(ValueError, match="master_address"):
        kvmove.MooncakeStore.embedded(master_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown store config field 'segment'"):
        kvmove.MooncakeStore.embedded(segment=1)


def test_a_stores_first_calls_start_no_thread():
    # A call that starts a thread pays ~0.1 ms for it: a fresh process's store starts the
    # threads its calls run on when it connects. Its first puts, gets and exists checks,
    # made straight from the caller (as SGLang's backend does), then start none.
    script = textwrap.dedent("""
        import threading, torch, kvmove
        with kvmove.MooncakeStore.embedded() as store:
            kv = kvmove.KVCache({"kv": torch.zeros(2, 64, 656, dtype=torch.uint8)})
            staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=4)
            store.register(staging)
            keys = [f"k{i}" for i in range(4)]
            threads = set(threading.enumerate())
            assert store.put(kvmove.describe(staging, [0, 1, 2, 3], keys)).all_ok
            assert store.get(kvmove.describe(staging, [4, 5, 6, 7], keys)).all_ok
            assert list(store.exists(keys)) == [True] * 4
            print(sorted(t.name for t in set(threading.enumerate()) - threads))
            store.unregister(staging)
            staging.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
