"""Store faults, against real embedded mooncake_master processes (nothing of Mooncake is
mocked; faults are real: a SIGKILLed master, a full segment, objects of another size):

- the master killed in the middle of a batch of puts and of gets run by a KVMover: every key
  gets a status (``OK`` before the kill, ``FAILED`` after), the KV rows of failed keys are
  untouched, the staging pool is full again; then a master restarted on the same address and
  the documented recovery (docs/API.md, "The store": keep the store and the mover,
  Mooncake's client reconnects by itself), ending with no leaked thread, process or registration;
- a full store: ``NO_SPACE`` per key, nothing stored is overwritten or lost, puts succeed
  again after ``remove``;
- gets of objects of another geometry: ``SIZE_MISMATCH``, no byte scattered.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import kvmove
from kvmove import Status
from tests.support.caches import make_layers, snapshot
from tests.support.process_table import masters_on_port, mooncake_masters, native_threads, wait_gone
from tests.support.staging_data import make_staging
from tests.support.store_state import registered_regions, swap_client

pytestmark = pytest.mark.store

PAGE = 4


def hybrid(slots: int) -> kvmove.KVCache:
    """A DSA-like hybrid cache: 656-byte kv rows on 3 layers, 132-byte indexer rows on 2."""
    return kvmove.KVCache({"kv": make_layers(3, slots, 656, torch.uint8, seed=21),
                           "indexer": make_layers(2, slots, 132, torch.float32, seed=22)})


def pages(first: int, n: int) -> torch.Tensor:
    """``n`` consecutive pages of ``PAGE`` token slots starting at slot ``first``."""
    return torch.arange(first, first + n * PAGE).reshape(n, PAGE)


def page_bytes(kv: kvmove.KVCache, rows: torch.Tensor) -> list[bytes]:
    """The bytes of ``rows`` in every buffer and layer (the page as the engine sees it)."""
    return [kv.layer(n, layer)[rows].contiguous().view(torch.uint8).numpy().tobytes()
            for n in kv.buffer_names for layer in range(kv.num_layers(n))]


def restore(kv: kvmove.KVCache, rows: torch.Tensor, blobs: list[bytes]) -> None:
    """Write ``page_bytes``-shaped ``blobs`` back into ``rows``."""
    it = iter(blobs)
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            t = kv.layer(n, layer)
            raw = torch.frombuffer(bytearray(next(it)), dtype=torch.uint8)
            t[rows] = raw.view(t.dtype).view(len(rows), *t.shape[1:])


class _KillAfterFirst:
    """A Mooncake client that forwards every call, and SIGKILLs ``master`` as soon as the
    first ``call`` has returned (before its caller sees the result)."""

    def __init__(self, real, master: kvmove.EmbeddedMaster, call: str):
        self._real, self._master, self._call = real, master, call
        self.killed: list[int] = []

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name != self._call:
            return fn

        def call_then_kill(*args):
            result = fn(*args)
            if not self.killed:
                self.killed.append(self._master.pid)
                os.kill(self._master.pid, signal.SIGKILL)
                assert wait_gone(self.killed[0], 5)
            return result

        call_then_kill.__name__ = name
        call_then_kill.__self__ = self
        return call_then_kill


def kill_master_after_first(store: kvmove.MooncakeStore, call: str) -> list[int]:
    """SIGKILL ``store``'s master as soon as the first Mooncake ``call`` returns, so that
    the rest of the batch (its later chunks) meets a dead master. Returns a list that
    receives the killed pid."""
    return swap_client(store, lambda real: _KillAfterFirst(real, store.master, call)).killed


def restart_and_recover(store, mover, probe_rows, tag: str, timeout: float = 20.0):
    """Restart the dead master on the same address and evict probe pages until one is
    stored: the store and the mover reconnect by themselves. Returns the statuses seen
    before the first ``OK`` and the seconds it took."""
    address, dead_pid = store.master.address, store.master.pid
    store.master.restart()
    assert store.master.address == address and store.master.pid != dead_pid
    t0, seen = time.monotonic(), []
    for i in range(10_000):
        status = mover.evict([f"probe-{tag}-{i}"], probe_rows).wait(30)[0]
        if status is Status.OK:
            return seen, time.monotonic() - t0
        seen.append(status)
        assert status in (Status.FAILED, Status.NO_SPACE), status
        assert time.monotonic() - t0 < timeout, f"no recovery within {timeout}s: {seen}"
        time.sleep(0.05)
    raise AssertionError("unreachable")


def test_master_killed_mid_batch_then_restarted_on_the_same_address(
        store, keyspace, capsys):
    # ``store`` (the session's) is requested, and asked once, so that Mooncake's
    # process-wide threads and the store's call runner exist before the threads are counted
    # (run alone, the test would otherwise count the runner's first thread as leaked).
    assert store.exists(keyspace(1, "warm")) == [False]
    threads_before = {t.name for t in threading.enumerate()}
    natives_before = native_threads()
    masters_before = set(mooncake_masters(children_of=os.getpid()))
    # Chunks of 4 keys, one at a time (32 spans in flight: a chunk is 20), so that the
    # kill falls between chunks.
    s = kvmove.MooncakeStore.embedded(global_segment_size="16mb", max_batch_keys=4,
                                      max_inflight_spans=32)
    port = s.master.rpc_port
    kv = hybrid(160)
    mover = kvmove.KVMover(kv, s, page_tokens=PAGE, staging_slots=16, key_prefix="faults")
    keys = keyspace(12)
    src, dst = pages(0, 12), pages(64, 12)
    original = [page_bytes(kv, p) for p in src]
    try:
        # -- puts: 3 chunks of 4 keys; the master dies after the first chunk is stored.
        before = snapshot(kv)
        killed = kill_master_after_first(s, "batch_put_from_multi_buffers")
        put = mover.evict(keys, src).result(60)
        assert killed, "the master was not killed"
        assert put.statuses == [Status.OK] * 4 + [Status.FAILED] * 8
        assert put.codes[4:] == [-900] * 8  # RPC_FAIL: the rest of the batch untried
        assert mover.staging.num_free == 16
        after = snapshot(kv)
        assert all(torch.equal(a, b) for n in before for a, b in zip(before[n], after[n],
                                                                      strict=True))

        # -- recovery: restart on the same address; the store reconnects by itself.
        seen, took = restart_and_recover(s, mover, pages(140, 1), "a")
        assert masters_on_port(port) == [s.master.pid]
        # Keys stored before the restart went with the master's metadata: MISS, no write.
        before = snapshot(kv)
        assert mover.prefetch(keys[:4], dst[:4]).wait(30) == [Status.MISS] * 4
        after = snapshot(kv)
        assert all(torch.equal(a, b) for n in before for a, b in zip(before[n], after[n],
                                                                      strict=True))

        # -- gets: store the 12 keys again, then kill the master after the first get chunk.
        assert mover.evict(keys, src).wait(30) == [Status.OK] * 12
        before = snapshot(kv)
        killed = kill_master_after_first(s, "batch_get_into_multi_buffers")
        got = mover.prefetch(keys, dst).result(60)
        assert killed, "the master was not killed"
        assert got.statuses == [Status.OK] * 4 + [Status.FAILED] * 8
        assert got.codes[4:] == [-900] * 8
        for i in range(4):  # the keys read before the kill are in place, byte for byte
            assert page_bytes(kv, dst[i]) == original[i]
        after = snapshot(kv)
        rows = dst[4:].reshape(-1)
        for n in kv.buffer_names:  # the failed keys' rows are untouched
            for a, b in zip(before[n], after[n], strict=True):
                assert torch.equal(a[rows], b[rows])
        assert mover.staging.num_free == 16

        # -- recovery again, and a full round trip with every byte checked.
        seen2, took2 = restart_and_recover(s, mover, pages(140, 1), "b")
        fresh = keyspace(4, "fresh")
        assert mover.evict(fresh, src[:4]).wait(30) == [Status.OK] * 4
        assert mover.prefetch(fresh, pages(100, 4)).wait(30) == [Status.OK] * 4
        for i in range(4):
            assert page_bytes(kv, pages(100, 4)[i]) == original[i]
        with capsys.disabled():
            print(f"\n[faults] recovery after restart: {took:.2f}s (statuses before OK: "
                  f"{[x.value for x in seen]}), {took2:.2f}s "
                  f"({[x.value for x in seen2]})")
    finally:
        mover.close()
        regions = set(mover.staging.regions())
        assert not regions & set(registered_regions(s)), "the mover left its staging registered"
        pid = s.master.pid
        s.close()
    # Nothing leaked: registrations, the master process, Python and native threads.
    assert registered_regions(s) == []
    assert wait_gone(pid, 10) and masters_on_port(port) == []
    assert set(mooncake_masters(children_of=os.getpid())) <= masters_before
    assert {t.name for t in threading.enumerate()} <= threads_before
    assert native_threads() <= natives_before + 2  # Mooncake's pools are process-wide


def test_full_store_is_no_space_per_key_and_keeps_what_it_stored(keyspace):
    # 1 MiB objects in Mooncake's smallest segment (16 MiB). The master's watermark eviction
    # is off, so what is stored stays stored (with it on, Mooncake drops old objects to make
    # room: they read back as MISS, never as other bytes).
    args = ["--eviction_ratio=0", "--eviction_high_watermark_ratio=1.0"]
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", master_args=args) as s:
        page = 64
        kv = kvmove.KVCache({"kv": make_layers(4, 32 * page, 4096, torch.uint8, seed=23)})
        mover = kvmove.KVMover(kv, s, page_tokens=page, staging_slots=24, key_prefix="full")
        try:
            rows = torch.arange(32 * page).reshape(32, page)
            original = [page_bytes(kv, r) for r in rows]
            keys = keyspace(28)
            first = mover.evict(keys[:24], rows[:24]).result(60)
            assert set(first.statuses) == {Status.OK, Status.NO_SPACE}, first.statuses
            assert all(c == -200 for c, st in zip(first.codes, first.statuses, strict=True)
                       if st is Status.NO_SPACE)
            stored = [i for i, st in enumerate(first.statuses) if st is Status.OK]
            refused = [i for i, st in enumerate(first.statuses) if st is Status.NO_SPACE]
            assert 8 <= len(stored) <= 16
            # Still full: more new keys are refused one by one.
            more = mover.evict(keys[24:28], rows[24:28]).wait(30)
            assert more == [Status.NO_SPACE] * 4
            # Nothing is overwritten: a second evict of a stored key with other bytes is
            # EXISTS, and every stored key reads back its first bytes.
            kv.layer("kv", 0)[rows[stored[0]]] ^= 0xFF
            assert mover.evict([keys[stored[0]]], rows[stored[0]][None]).wait(30) == [
                Status.EXISTS]
            kv.layer("kv", 0)[rows[stored[0]]] ^= 0xFF
            for n in kv.buffer_names:
                for layer in range(kv.num_layers(n)):
                    kv.layer(n, layer)[rows[:24].reshape(-1)] = 0
            back = mover.prefetch([keys[i] for i in stored],
                                  rows[stored]).wait(60)
            assert back == [Status.OK] * len(stored)
            for i in stored:
                assert page_bytes(kv, rows[i]) == original[i]
            # The refused keys were never stored: MISS, and their rows stay zero.
            assert mover.prefetch([keys[i] for i in refused[:4]],
                                  rows[refused[:4]]).wait(30) == [Status.MISS] * 4
            assert all(b == bytes(len(b)) for i in refused[:4] for b in page_bytes(kv, rows[i]))
            # After remove (forced: the prefetch leased them), the refused keys fit.
            gone = s.remove(mover.keyspace.store_keys([keys[i] for i in stored[:4]]),
                            force=True)
            assert gone == [Status.OK] * 4
            for i in refused[:4]:  # the engine's rows hold the page again
                restore(kv, rows[i], original[i])
            retry = mover.evict([keys[i] for i in refused[:4]], rows[refused[:4]]).wait(30)
            assert retry == [Status.OK] * 4
            got = mover.prefetch([keys[i] for i in refused[:4]], rows[24:28]).wait(30)
            assert got == [Status.OK] * 4
            for j, i in enumerate(refused[:4]):
                assert page_bytes(kv, rows[24 + j]) == original[i]
            assert mover.staging.num_free == 24
        finally:
            mover.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_get_of_another_geometry_is_size_mismatch_and_scatters_nothing(
        store, keyspace, layerwise):
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8, key_prefix="geom")
    try:
        keys = keyspace(3)
        smaller, larger = mover.keyspace.store_keys(keys[:2])
        # Objects of other geometries under the mover's own store keys: one smaller than
        # the mover's object (an MLA page), one larger (more layers, wider rows).
        mla = make_staging({"kv": (3, 656)}, num_slots=1, page_tokens=PAGE, seed=24)
        wide = make_staging({"kv": (6, 1152)}, num_slots=1, page_tokens=PAGE, seed=25)
        assert store.put(kvmove.describe(mla, [0], [smaller])).all_ok
        assert store.put(kvmove.describe(wide, [0], [larger])).all_ok
        assert mover.evict(keys[2:], pages(0, 1)).wait(30) == [Status.OK]
        want = page_bytes(kv, pages(0, 1)[0])
        before = snapshot(kv)
        result = mover.prefetch(keys, pages(32, 3), layerwise=layerwise).result(30)
        assert result.statuses == [Status.SIZE_MISMATCH, Status.SIZE_MISMATCH, Status.OK]
        assert result.codes[:2] == [-800, -600]  # destination larger / smaller than object
        assert page_bytes(kv, pages(32, 3)[2]) == want
        after = snapshot(kv)
        rows = pages(32, 2).reshape(-1)
        for n in kv.buffer_names:
            for a, b in zip(before[n], after[n], strict=True):
                assert torch.equal(a[rows], b[rows])
        assert mover.staging.num_free == mover.staging.num_slots
    finally:
        mover.close()
