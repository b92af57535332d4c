"""Concurrency and lifecycle, against a real embedded mooncake_master: threads evicting and
prefetching overlapping keys, an evict racing a prefetch of the same key, ``close()`` while
transfers run (the mover's and the store's), registering twice, unregistering a region in
use, and processes with an embedded master killed by SIGTERM and SIGKILL.

Where a test needs a transfer to be "in flight" at a known moment, it holds one Mooncake
call at a gate inside the store (``store._bounded``, through which kvmove makes each
Mooncake call, and ``store._check_then_put``, a put's exists check and its put in one call):
the real Mooncake call still runs, before or after the gate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from typing import ClassVar

import numpy as np
import pytest
import torch

import kvmove
from kvmove import Status
from tests.support.caches import make_layers, write_random
from tests.support.process_table import masters_on_port, wait_gone
from tests.support.store_state import regions_in_use, registered_regions
from tests.support.threads import close_while_calling

pytestmark = pytest.mark.store

PAGE = 4
GET = "batch_get_into_multi_buffers"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hybrid(slots: int, seed: int = 31) -> kvmove.KVCache:
    """A DSA-like hybrid cache: 656-byte kv rows on 3 layers, 132-byte indexer rows on 2."""
    return kvmove.KVCache({"kv": make_layers(3, slots, 656, torch.uint8, seed=seed),
                           "indexer": make_layers(2, slots, 132, torch.float32, seed=seed + 1)})


def pages(first: int, n: int) -> torch.Tensor:
    """``n`` consecutive pages of ``PAGE`` token slots starting at slot ``first``."""
    return torch.arange(first, first + n * PAGE).reshape(n, PAGE)


def page_bytes(kv: kvmove.KVCache, rows: torch.Tensor) -> bytes:
    """Every byte of the page ``rows`` (all buffers and layers), as the engine sees it."""
    return b"".join(kv.layer(n, layer)[rows].contiguous().view(torch.uint8).numpy().tobytes()
                    for n in kv.buffer_names for layer in range(kv.num_layers(n)))


def scribble(kv: kvmove.KVCache, rows: torch.Tensor, value: int = 0x5A) -> None:
    """A known byte pattern in ``rows`` of every buffer and layer."""
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            kv.layer(n, layer).view(torch.uint8)[rows] = value


class Gate:
    """Holds Mooncake calls named ``call`` made through ``store`` (the first ``count``
    of them) until :meth:`open`, either before the real call (``when="before"``) or after
    it (``"after"``: the bytes are in staging, the transfer not finished)."""

    _all: ClassVar[list[Gate]] = []

    def __init__(self, store, monkeypatch, call: str = GET, when: str = "before",
                 count: int = 1):
        Gate._all.append(self)
        self.entered = threading.Event()
        self._release = threading.Event()
        self._left = count
        self._lock = threading.Lock()
        real_bounded, real_check_then_put = store._bounded, store._check_then_put

        def held(name: str, run):
            with self._lock:
                hold = name == call and self._left > 0
                self._left -= hold
            if hold and when == "before":
                self._hold()
            result = run()
            if hold and when == "after":
                self._hold()
            return result

        def bounded(fn, *args, **options):
            return held(fn.__name__, lambda: real_bounded(fn, *args, **options))

        def check_then_put(client, part):  # a put's exists check and the put, in one call
            return held("batch_put_from_multi_buffers",
                        lambda: real_check_then_put(client, part))

        monkeypatch.setattr(store, "_bounded", bounded)
        monkeypatch.setattr(store, "_check_then_put", check_then_put)

    def _hold(self) -> None:
        self.entered.set()
        assert self._release.wait(60), "gate never opened"

    def wait_entered(self) -> None:
        assert self.entered.wait(30), "no call reached the gate"

    def open(self) -> None:
        self._release.set()

    @classmethod
    def open_all(cls) -> None:
        """Open every gate (so that a failing test does not leave a transfer held)."""
        while cls._all:
            cls._all.pop().open()


@pytest.fixture(autouse=True)
def _open_gates():
    yield
    Gate.open_all()


# -- concurrency ---------------------------------------------------------------------------


def test_threads_evicting_and_prefetching_overlapping_keys(store, keyspace):
    threads, rounds, pool = 4, 16, 10
    kv = hybrid(threads * 2 * 3 * PAGE)
    # workers as engines may compute it: a numpy int is an int
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=16,
                           workers=np.int64(3), key_prefix="overlap")
    keys = keyspace(pool)
    stored_by: dict[str, list[bytes]] = defaultdict(list)  # bytes of each evict that was OK
    read: dict[str, list[bytes]] = defaultdict(list)  # bytes of each OK prefetch
    counts: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = random.Random(w)
        gen = torch.Generator().manual_seed(100 + w)
        src, dst = pages(w * 6 * PAGE, 3), pages(w * 6 * PAGE + 3 * PAGE, 3)
        try:
            for _ in range(rounds):
                chosen = rng.sample(keys, rng.randint(1, 3))
                n = len(chosen)
                if rng.random() < 0.5:
                    write_random(kv, src[:n].reshape(-1), gen)  # every evict has bytes of its own
                    blobs = [page_bytes(kv, p) for p in src[:n]]
                    statuses = mover.evict(chosen, src[:n]).wait(60)
                    with lock:
                        for key, st, blob in zip(chosen, statuses, blobs, strict=True):
                            assert st in (Status.OK, Status.EXISTS), (key, st)
                            counts[f"evict {st.value}"] += 1
                            if st is Status.OK:
                                stored_by[key].append(blob)
                else:
                    scribble(kv, dst[:n].reshape(-1))
                    pattern = page_bytes(kv, dst[0])
                    result = mover.prefetch(chosen, dst[:n]).result(60)
                    with lock:
                        for key, st, code, p in zip(chosen, result.statuses, result.codes,
                                                    dst[:n], strict=True):
                            # MISS: not stored yet, or (-703) its put not finished yet
                            assert st in (Status.OK, Status.MISS), (key, st, code)
                            if code < 0:
                                counts[f"prefetch code {code}"] += 1
                            counts[f"prefetch {st.value}"] += 1
                            got = page_bytes(kv, p)
                            if st is Status.OK:
                                read[key].append(got)
                            else:
                                assert got == pattern, f"a MISS wrote into the rows of {key}"
        except BaseException as e:  # surfaced below
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    try:
        assert errors == [], errors
        assert counts["prefetch ok"] > 0 and counts["evict ok"] > 0
        for key, blobs in read.items():
            # Every OK prefetch gave exactly the bytes of an evict of that key, and always
            # the same ones (the first object stored is kept).
            assert len(set(blobs)) == 1, f"{key}: prefetches read different bytes"
            assert blobs[0] in stored_by[key], f"{key}: bytes of no evict of this key"
        # Every key evicted OK reads back now, as one of its evicts' bytes.
        evicted = sorted(stored_by)
        final = mover.prefetch(evicted, pages(0, len(evicted))).wait(60)
        assert final == [Status.OK] * len(evicted)
        for key, p in zip(evicted, pages(0, len(evicted)), strict=True):
            assert page_bytes(kv, p) in stored_by[key]
            if read.get(key):
                assert page_bytes(kv, p) == read[key][0]
        assert mover.staging.num_free == mover.staging.num_slots
    finally:
        Gate.open_all()
        mover.close()
    print(f"\n[lifecycle] overlapping keys: {dict(counts)}")


@pytest.mark.parametrize("stored_first", [True, False])
def test_evict_of_a_key_while_its_prefetch_is_in_flight(store, keyspace, monkeypatch,
                                                         stored_first):
    kv = hybrid(64)
    gen = torch.Generator().manual_seed(7)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8, key_prefix="race")
    key = keyspace(1)
    src, dst = pages(0, 1), pages(32, 1)
    try:
        first = page_bytes(kv, src[0])
        if stored_first:
            assert mover.evict(key, src).wait(30) == [Status.OK]
        # The prefetch holds after Mooncake answered: its bytes (or its MISS) are in.
        gate = Gate(store, monkeypatch, when="after")
        scribble(kv, dst.reshape(-1))
        untouched = page_bytes(kv, dst[0])
        p = mover.prefetch(key, dst)
        gate.wait_entered()
        write_random(kv, src.reshape(-1), gen)  # other bytes under the same key
        second = page_bytes(kv, src[0])
        assert second != first
        e = mover.evict(key, src).wait(30)
        assert e == [Status.EXISTS] if stored_first else [Status.OK]
        assert not p.done()
        gate.open()
        if stored_first:  # the prefetch scatters the first object; the evict changed nothing
            assert p.wait(30) == [Status.OK]
            assert page_bytes(kv, dst[0]) == first
        else:  # the prefetch had missed before the evict: nothing written
            assert p.wait(30) == [Status.MISS]
            assert page_bytes(kv, dst[0]) == untouched
        # A later prefetch reads whatever is stored: the first evict that was OK.
        assert mover.prefetch(key, pages(40, 1)).wait(30) == [Status.OK]
        assert page_bytes(kv, pages(40, 1)[0]) == (first if stored_first else second)
        assert mover.staging.num_free == mover.staging.num_slots
    finally:
        Gate.open_all()
        mover.close()


def test_prefetch_that_reaches_the_store_after_an_evict_reads_it(store, keyspace, monkeypatch):
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8, key_prefix="race2")
    key = keyspace(1)
    try:
        gate = Gate(store, monkeypatch, when="before")  # the get has not asked Mooncake yet
        p = mover.prefetch(key, pages(32, 1))
        gate.wait_entered()
        assert mover.evict(key, pages(0, 1)).wait(30) == [Status.OK]
        gate.open()
        assert p.wait(30) == [Status.OK]
        assert page_bytes(kv, pages(32, 1)[0]) == page_bytes(kv, pages(0, 1)[0])
    finally:
        Gate.open_all()
        mover.close()


# -- close ---------------------------------------------------------------------------------


def test_mover_close_while_transfers_run_waits_then_unregisters(store, keyspace, monkeypatch,
                                                                caplog):
    kv = hybrid(96)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=16, key_prefix="close")
    keys = keyspace(6)
    want = [page_bytes(kv, p) for p in pages(0, 6)]
    assert mover.evict(keys[:3], pages(0, 3)).wait(30) == [Status.OK] * 3
    gate = Gate(store, monkeypatch, when="before")
    prefetch = mover.prefetch(keys[:3], pages(48, 3))
    evict = mover.evict(keys[3:], pages(3, 3))
    gate.wait_entered()
    closer = threading.Thread(target=mover.close)
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        closer.start()
        closer.join(0.3)
        assert closer.is_alive(), "close() returned while a transfer was in flight"
        free = mover.staging.num_free
        with pytest.raises(kvmove.KVMoveError, match="closed"):
            mover.evict(keyspace(1, "late"), pages(10, 1))
        assert mover.staging.num_free == free  # the refused call holds no slot
        regions = set(mover.staging.regions())
        assert regions <= set(registered_regions(store))  # still registered: in use
        gate.open()
        closer.join(30)
        assert not closer.is_alive()
    assert prefetch.done() and evict.done()
    assert prefetch.wait(0) == [Status.OK] * 3 and evict.wait(0) == [Status.OK] * 3
    for i, p in enumerate(pages(48, 3)):
        assert page_bytes(kv, p) == want[i]
    assert mover.staging.num_free == mover.staging.num_slots
    assert not regions & set(registered_regions(store))
    assert not [r for r in caplog.records if "unregister" in r.getMessage()], \
        "the mover's close tripped the store's in-use check"


def test_mover_close_racing_callers_leaks_no_slot(store, keyspace):
    kv = hybrid(256)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=16, key_prefix="race3")

    def evict(w: int, i: int) -> str:
        mover.evict([f"{w}-{i}"], pages(w * 2 * PAGE, 2)[:1])
        return "submitted"

    outcomes = close_while_calling(evict, mover.close)
    assert outcomes["submitted"] > 0 and outcomes["refused"] > 0, outcomes
    assert mover.staging.num_free == mover.staging.num_slots


def test_prefetches_waiting_for_slots_never_hold_up_the_puts_that_free_them(store, keyspace,
                                                                           monkeypatch):
    # Two slots, two workers: a held put keeps one slot; two prefetches of two keys each wait
    # for slots; a later evict takes the other slot. Its put must run although every get
    # worker waits: the prefetches then get their slots and every key arrives.
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=2, alloc_timeout=5.0,
                           path="staged", key_prefix="starve")
    try:
        keys = keyspace(6)
        want = [page_bytes(kv, p) for p in pages(0, 4)]
        assert mover.evict(keys[:4], pages(0, 4)).wait(30) == [Status.OK] * 4
        gate = Gate(store, monkeypatch, call="batch_put_from_multi_buffers")
        held = mover.evict(keys[4:5], pages(16, 1))
        gate.wait_entered()
        first = mover.prefetch(keys[:2], pages(32, 2))
        second = mover.prefetch(keys[2:4], pages(40, 2))
        time.sleep(0.2)  # both prefetches are waiting for slots (or queued behind that)
        later = mover.evict(keys[5:6], pages(20, 1))
        gate.open()
        assert first.result(30).statuses == [Status.OK] * 2, first.result(0).codes
        assert second.result(30).statuses == [Status.OK] * 2, second.result(0).codes
        assert held.wait(30) == [Status.OK] and later.wait(30) == [Status.OK]
        for i, p in enumerate(pages(32, 4)):
            assert page_bytes(kv, p) == want[i]
        assert mover.staging.num_free == 2
    finally:
        mover.close()


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_valid_tokens_are_taken_at_call_time(store, keyspace, monkeypatch, kind):
    # The engine may reuse its valid_tokens buffer once evict() returns, as it may reuse its
    # index tensors: what is stored is what the call was given.
    kv = hybrid(64)
    with kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=8, workers=1,
                        key_prefix=f"vt-{kind}") as mover:
        keys = keyspace(3)
        want = [page_bytes(kv, p) for p in pages(0, 2)]
        gate = Gate(store, monkeypatch, call="batch_put_from_multi_buffers")
        first = mover.evict(keys[2:], pages(16, 1))  # its put holds the only worker
        gate.wait_entered()
        valid = torch.tensor([PAGE, PAGE])
        if kind == "ndarray":
            valid = valid.numpy()
        t = mover.evict(keys[:2], pages(0, 2), valid_tokens=valid)
        valid[:] = 1
        gate.open()
        assert t.wait(30) == [Status.OK] * 2 and first.wait(30) == [Status.OK]
        assert mover.prefetch(keys[:2], pages(8, 2)).wait(30) == [Status.OK] * 2
        for i, p in enumerate(pages(8, 2)):
            assert page_bytes(kv, p) == want[i]


@pytest.mark.parametrize(("call", "path"), [("prefetch", "in_place"), ("evict", "in_place"),
                                           ("prefetch", "staged")])
def test_close_waits_for_work_on_a_callers_thread(store, keyspace, call, path):
    # A caller's thread runs the store call itself: in place on the CPU an evict always, and
    # a prefetch (in place or staged) when its wait() finds the job not started. A caller
    # paused between deciding to run it and being counted (widened here to 0.3 s) must
    # either be refused or be waited for by close(): never run after close() returned (in
    # place it would register the KV memory again and write a padding row into freed memory;
    # staged, get into freed staging).
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, workers=1,
                           path=path, key_prefix=f"late-{call}-{path}")
    keys = keyspace(2)
    regions = set((mover._rows or mover.staging).regions())
    ran_at: list[float] = []
    runner = mover._evict_path if call == "evict" else mover._prefetch_path
    job = ("_put" if call == "evict" else "_get" if path == "in_place" else "_get_job")
    inner_job, inner_guard = getattr(runner, job), mover._life.inline_run

    def timed(*args):
        time.sleep(0.3)  # a run close() did not wait for would end well after it returned
        try:
            return inner_job(*args)
        finally:
            ran_at.append(time.monotonic())

    @contextlib.contextmanager
    def paused_guard():
        time.sleep(0.3)
        with inner_guard() as allowed:
            yield allowed

    gate = threading.Event()
    out: dict = {}
    if call == "prefetch":
        assert mover.evict(keys[:1], pages(0, 1)).wait(30) == [Status.OK]
        mover._life.executor.submit(gate.wait)  # the only worker is busy: wait() runs it
        setattr(runner, job, timed)
        mover._life.inline_run = paused_guard
        t = mover.prefetch(keys[:1], torch.tensor([[8, 9, -1, 11]]))
        caller = threading.Thread(target=lambda: out.setdefault("st", t.wait()))  # unbounded
    else:
        setattr(runner, job, timed)
        mover._life.inline_run = paused_guard

        def evict():
            try:
                out["st"] = mover.evict(keys[1:], pages(4, 1)).wait(30)
            except kvmove.KVMoveError as e:
                out["refused"] = str(e)

        caller = threading.Thread(target=evict)
    caller.start()
    time.sleep(0.1)  # the caller is paused before the count
    closer = threading.Thread(target=mover.close)
    closer.start()
    # The worker stays busy until the paused caller has decided (0.3 s): a prefetch's job is
    # still unclaimed then, so the guard alone decides whether the caller runs it.
    time.sleep(0.4)
    gate.set()
    closer.join(30)
    closed_at = time.monotonic()
    caller.join(30)
    assert not closer.is_alive() and not caller.is_alive()
    assert all(t <= closed_at for t in ran_at), "the store call ran after close() returned"
    assert out.get("st") == [Status.OK] or "closed" in out.get("refused", ""), out
    assert not regions & set(registered_regions(store))


def _busy_worker_and_job_threads(mover):
    """Occupy the mover's only worker until the returned event is set; record on which
    thread each staged prefetch job runs (the list returned)."""
    ran_on: list[threading.Thread] = []
    inner = mover._prefetch_path._get_job

    def recorded(*args):
        ran_on.append(threading.current_thread())
        return inner(*args)

    mover._prefetch_path._get_job = recorded
    gate = threading.Event()
    mover._life.executor.submit(gate.wait, 30)
    return gate, ran_on


def mover_workers() -> set[threading.Thread]:
    """The worker threads of every mover in this process (named by their pools)."""
    return {t for t in threading.enumerate() if re.fullmatch(r"kvmove(-put)?_\d+", t.name)}


def test_a_movers_workers_start_when_it_is_built_not_in_its_first_calls(store, keyspace):
    # A call that starts a thread pays ~0.1 ms for it: the mover starts its workers (both
    # pools) when it is built, and its first evict and prefetch start none.
    before = mover_workers()
    mover = kvmove.KVMover(hybrid(64), store, page_tokens=PAGE, staging_slots=4, workers=2,
                           path="staged", key_prefix="workers-built")
    built = mover_workers() - before
    assert sorted(t.name for t in built) == ["kvmove-put_0", "kvmove-put_1", "kvmove_0",
                                             "kvmove_1"]
    keys = keyspace(2)
    assert mover.evict(keys, pages(0, 2)).wait() == [Status.OK] * 2
    assert mover.prefetch(keys, pages(8, 2)).wait() == [Status.OK] * 2
    assert mover_workers() - before == built
    mover.close()
    assert not any(t.is_alive() for t in built)


def test_a_mover_whose_build_fails_leaves_no_worker_running(store, monkeypatch):
    # The workers start before the staging is registered with the store: where that
    # fails, the half-built mover's workers end with it, even while the caller keeps the
    # error (its traceback holds the mover).
    before = mover_workers()

    def refuse(staging):
        raise kvmove.StoreError("no memory for you")

    monkeypatch.setattr(store, "register", refuse)
    with pytest.raises(kvmove.StoreError, match="no memory for you") as failed:
        kvmove.KVMover(hybrid(64), store, page_tokens=PAGE, staging_slots=4, workers=2,
                       path="staged", key_prefix="build-fails")
    deadline = time.monotonic() + 10
    while mover_workers() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mover_workers() - before == set()
    assert failed.tb is not None  # kept until here


def test_a_movers_first_calls_import_nothing_and_start_no_thread():
    # An import inside a call is a one-off stall of the engine's step (numpy's np.unique
    # imported numpy.ma on its first call: 7 ms in a first evict), a thread started by one
    # ~0.1 ms. A fresh process (torch's threads sleeping between parallel regions, where
    # host copies of 1 MiB and more are split over helper threads) builds a staged and an
    # in-place mover, then evicts and prefetches 5 MiB (scattered pages of 8-16 valid
    # tokens, layer by layer too) through each: no module is imported, no thread started,
    # from the first call on.
    script = textwrap.dedent("""
        import sys, threading, torch, kvmove
        with kvmove.MooncakeStore.embedded() as store:
            kv = kvmove.KVCache({"kv": [torch.zeros(4096, 656, dtype=torch.uint8)
                                        for _ in range(6)]})
            movers = [kvmove.KVMover(kv, store, page_tokens=16, staging_slots=80, path=path,
                                     key_prefix=path)
                      for path in ("staged", "in_place")]
            before, threads = set(sys.modules), set(threading.enumerate())
            for mover in movers:
                keys = [f"{mover.path}-{i}" for i in range(80)]
                pages = torch.arange(158, -1, -2)[:, None] * 16 + torch.arange(16)
                valid = [16, 8, 12, 16] * 20
                ok = [kvmove.Status.OK] * 80
                assert mover.evict(keys, pages, valid_tokens=valid).wait() == ok
                for layerwise in (False, True):
                    assert mover.prefetch(keys, pages + 16, valid_tokens=valid,
                                          layerwise=layerwise).wait() == ok
                mover.close()
            print(sorted(set(sys.modules) - before))
            print(sorted(t.name for t in set(threading.enumerate()) - threads))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["[]", "[]"], out.stdout


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_waiting_caller_runs_a_queued_staged_prefetch_itself(store, keyspace, layerwise):
    # Staged, every layer at once or layer by layer: a caller whose unbounded wait() finds
    # the job still queued (the only worker busy) runs it on its own thread (no hand-off,
    # no wait for a worker to wake), with the same statuses and bytes. Layer by layer, a
    # wait_layer() waiting beside it gets its layer from that run (it never runs the job).
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, workers=1,
                           path="staged", key_prefix=f"staged-steal-{layerwise}")
    keys = keyspace(3)
    assert mover.evict(keys[:2], pages(0, 2)).wait() == [Status.OK] * 2
    gate, ran_on = _busy_worker_and_job_threads(mover)
    try:
        t = mover.prefetch(keys, pages(8, 3), layerwise=layerwise)
        beside_got = []
        beside = [threading.Thread(target=lambda: beside_got.append(
            t.wait_layer(kv.max_layers - 1))) for _ in range(layerwise)]
        for waiter in beside:
            waiter.start()
        assert t.wait() == [Status.OK, Status.OK, Status.MISS]
        for waiter in beside:
            waiter.join(30)
        assert beside_got == [None] * layerwise  # it returned, without an error
    finally:
        gate.set()
    assert ran_on == [threading.current_thread()]
    for src, dst in zip(pages(0, 2), pages(8, 2), strict=True):
        assert page_bytes(kv, dst) == page_bytes(kv, src)
    mover.close()


def test_a_layerwise_staged_prefetch_is_left_to_a_worker_by_wait_layer(store, keyspace):
    # Layer by layer the engine waits for each layer while the next ones are scattered: a
    # wait_layer() that ran the whole job itself would return from wait_layer(0) only once
    # every layer is in place. It waits for the worker instead.
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, workers=1,
                           path="staged", key_prefix="staged-layerwise")
    keys = keyspace(2)
    assert mover.evict(keys, pages(0, 2)).wait() == [Status.OK] * 2
    gate, ran_on = _busy_worker_and_job_threads(mover)
    try:
        t = mover.prefetch(keys, pages(8, 2), layerwise=True)
        waiter = threading.Thread(target=t.wait_layer, args=(0,))
        waiter.start()
        time.sleep(0.3)
        assert ran_on == [] and waiter.is_alive()
    finally:
        gate.set()
    waiter.join(30)
    assert t.wait(30) == [Status.OK] * 2
    assert len(ran_on) == 1 and ran_on[0].name.startswith("kvmove")
    for src, dst in zip(pages(0, 2), pages(8, 2), strict=True):
        assert page_bytes(kv, dst) == page_bytes(kv, src)
    mover.close()


@pytest.mark.parametrize("path", ["in_place", "staged"])
@pytest.mark.parametrize(("how", "layerwise"), [("wait", False), ("wait_layer", False),
                                               ("wait_layer", True)])
def test_a_bounded_wait_never_runs_a_queued_prefetch_itself(store, keyspace, how, layerwise,
                                                            path):
    # An engine polling a prefetch with a timeout must get its TimeoutError on time: the
    # store call is not run on its thread (it may take longer than the timeout).
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, workers=1,
                           path=path, key_prefix=f"bounded-{path}")
    keys = keyspace(1)
    assert mover.evict(keys, pages(0, 1)).wait() == [Status.OK]
    gate = threading.Event()
    try:
        mover._life.executor.submit(gate.wait, 30)  # the only worker is busy: it stays queued
        t = mover.prefetch(keys, pages(8, 1), layerwise=layerwise)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            t.wait(0.05) if how == "wait" else t.wait_layer(0, 0.05)
        assert time.monotonic() - t0 < 5 and not t.done()
    finally:
        gate.set()
    assert t.wait() == [Status.OK]
    assert page_bytes(kv, pages(8, 1)[0]) == page_bytes(kv, pages(0, 1)[0])
    mover.close()


def test_an_evict_in_pieces_racing_close_reports_the_pieces_it_put(store, keyspace,
                                                                   monkeypatch):
    # Its first piece is put; close() comes while the second waits for slots: the call
    # returns every key's status (it raised, and the caller never learnt what was stored).
    kv = hybrid(64)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=2, path="staged",
                           key_prefix="pieces")
    keys = keyspace(6)
    gate = Gate(store, monkeypatch, call="batch_put_from_multi_buffers")
    out: dict = {}
    caller = threading.Thread(
        target=lambda: out.setdefault("transfer", mover.evict(keys, pages(0, 6))))
    caller.start()
    gate.wait_entered()  # piece 0 is at the store; piece 1 waits for its slots
    closer = threading.Thread(target=mover.close)
    closer.start()
    time.sleep(0.2)
    gate.open()
    caller.join(30)
    closer.join(30)
    assert not caller.is_alive() and not closer.is_alive()
    result = out["transfer"].result()
    assert result.statuses[:2] == [Status.OK] * 2
    assert result.statuses[2:] == [Status.FAILED] * 4
    assert result.codes[2:] == [kvmove.status.MOVER_CLOSED] * 4
    stored = store.exists(mover.keyspace.store_keys(keys))
    assert stored == [s is Status.OK for s in result.statuses]


def test_store_close_while_transfers_run_waits_then_fails_new_calls(keyspace, monkeypatch):
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb") as s:
        kv = hybrid(64)
        mover = kvmove.KVMover(kv, s, page_tokens=PAGE, staging_slots=8, key_prefix="sclose")
        keys = keyspace(4)
        try:
            assert mover.evict(keys[:2], pages(0, 2)).wait(30) == [Status.OK] * 2
            gate = Gate(s, monkeypatch, when="before")
            p = mover.prefetch(keys[:2], pages(32, 2))
            gate.wait_entered()
            closer = threading.Thread(target=s.close)
            closer.start()
            closer.join(0.3)
            assert closer.is_alive(), "store.close() returned while a get was in flight"
            gate.open()
            closer.join(60)
            assert not closer.is_alive() and s.closed
            # The call in flight finished normally; new ones fail per key, never raise.
            assert p.wait(30) == [Status.OK] * 2
            assert page_bytes(kv, pages(32, 1)[0]) == page_bytes(kv, pages(0, 1)[0])
            before = page_bytes(kv, pages(40, 1)[0])
            assert mover.evict(keys[2:], pages(8, 2)).wait(30) == [Status.FAILED] * 2
            assert mover.prefetch(keys[:1], pages(40, 1)).wait(30) == [Status.FAILED]
            assert page_bytes(kv, pages(40, 1)[0]) == before
            assert mover.staging.num_free == mover.staging.num_slots
        finally:
            Gate.open_all()
            mover.close()  # logs that the closed store cannot unregister; does not raise


# -- registration --------------------------------------------------------------------------


def test_registering_the_same_staging_twice_is_harmless(store, keyspace):
    kv = hybrid(32)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, key_prefix="reg2")
    regions = mover.staging.regions()
    try:
        store.register(mover.staging)
        store.register(mover.staging)
        store.register(regions)  # as plain (address, nbytes) regions, too
        registered = registered_regions(store)
        assert all(registered.count(r) == 1 for r in regions)
        keys = keyspace(2)
        assert mover.evict(keys, pages(0, 2)).wait(30) == [Status.OK] * 2
        assert mover.prefetch(keys, pages(16, 2)).wait(30) == [Status.OK] * 2
        assert page_bytes(kv, pages(16, 1)[0]) == page_bytes(kv, pages(0, 1)[0])
        assert registered_regions(store).count(regions[0]) == 1
    finally:
        Gate.open_all()
        mover.close()
    assert not set(regions) & set(registered_regions(store))  # one unregister undid them


def test_unregistering_a_region_in_use_is_refused(store, keyspace, monkeypatch):
    kv = hybrid(32)
    mover = kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, key_prefix="busy",
                           path="staged")  # the staging's regions in use
    regions = mover.staging.regions()
    keys = keyspace(2)
    try:
        assert mover.evict(keys, pages(0, 2)).wait(30) == [Status.OK] * 2
        gate = Gate(store, monkeypatch, when="before")
        p = mover.prefetch(keys, pages(16, 2))
        gate.wait_entered()
        assert set(regions_in_use(store)) >= {a for a, _ in regions}
        with pytest.raises(kvmove.StoreError, match=r"in flight are using it"):
            store.unregister(mover.staging)
        assert set(regions) <= set(registered_regions(store))  # nothing was unregistered
        gate.open()
        assert p.wait(30) == [Status.OK] * 2
        assert page_bytes(kv, pages(16, 1)[0]) == page_bytes(kv, pages(0, 1)[0])
        assert not set(regions_in_use(store)) & {a for a, _ in regions}
        store.unregister(mover.staging)  # idle now: allowed
        assert not set(regions) & set(registered_regions(store))
        # put/get register the staging again by themselves
        assert mover.prefetch(keys[:1], pages(24, 1)).wait(30) == [Status.OK]
        assert set(regions) <= set(registered_regions(store))
    finally:
        Gate.open_all()
        mover.close()


def test_descriptors_built_from_lists_count_as_users_too(store, keyspace, monkeypatch):
    # Descriptors made from plain lists name no regions: the store finds the registered
    # regions their spans start in.
    staging = kvmove.StagingBuffer(hybrid(8), num_slots=2, page_tokens=PAGE)
    store.register(staging)
    made = kvmove.describe(staging, [0], keyspace(1))
    plain = kvmove.Descriptors(made.keys, made.ptrs, made.sizes)
    assert plain.regions == ()
    gate = Gate(store, monkeypatch, call="batch_put_from_multi_buffers")
    result: list = []
    putter = threading.Thread(target=lambda: result.append(store.put(plain)))
    putter.start()
    try:
        gate.wait_entered()
        with pytest.raises(kvmove.StoreError, match="in flight are using it"):
            store.unregister(staging)
    finally:
        gate.open()
        putter.join(30)
    assert result == [[Status.OK]]
    store.unregister(staging)
    assert not set(staging.regions()) & set(registered_regions(store))


# -- processes killed -----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, torch, kvmove
    store = kvmove.MooncakeStore.embedded(global_segment_size="16mb")
    kv = kvmove.KVCache({"kv": torch.zeros(2, 256, 656, dtype=torch.uint8)})
    mover = kvmove.KVMover(kv, store, page_tokens=4, staging_slots=16)
    print(json.dumps({"pid": store.master.pid, "port": store.master.rpc_port,
                      "log": store.master.log_path}), flush=True)
    i = 0
    while True:  # transfers are running when the signal comes
        keys = [f"k{i}-{j}" for j in range(8)]
        mover.evict(keys, torch.arange(32).reshape(8, 4)).wait(30)
        mover.prefetch(keys, torch.arange(32, 64).reshape(8, 4)).wait(30)
        i += 1
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_process_killed_leaves_no_orphan_master(sig):
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        info = json.loads(proc.stdout.readline())
        assert masters_on_port(info["port"]) == [info["pid"]]
        time.sleep(0.5)  # evicts and prefetches are in flight
        proc.send_signal(sig)
        assert proc.wait(30) == -sig  # the process ends by that signal, as by default
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert wait_gone(info["pid"], 10), f"mooncake_master {info['pid']} outlived its parent"
    assert masters_on_port(info["port"]) == []  # no orphan anywhere in the process table
    if sig == signal.SIGTERM:  # kvmove's handler ran the clean-up
        assert not os.path.exists(info["log"])
    else:  # nobody was left to remove the log
        os.unlink(info["log"])


def test_an_application_sigterm_handler_is_kept():
    script = textwrap.dedent("""
        import signal
        def mine(signum, frame):
            pass
        signal.signal(signal.SIGTERM, mine)
        from kvmove.store.embedded_master import EmbeddedMaster
        with EmbeddedMaster():
            assert signal.getsignal(signal.SIGTERM) is mine
        print("kept")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "kept", out.stderr[-2000:]
