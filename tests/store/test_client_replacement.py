"""The store's client replacement and a master that stops answering, against real embedded
``mooncake_master`` processes:

- a client replaced (after a call given up) while a put/get of several chunks still runs on
  it is closed only once that put/get has ended (closing it under the call is a segfault);
- a master that accepts connections but does not answer (SIGSTOP): opening a store raises
  ``StoreError`` within ``connect_timeout``, and a client replacement is postponed, without
  freezing the process (Mooncake's ``setup()`` against it waits with the GIL held);
- a get whose keys answer ``-800`` while the master stopped answering (stalled Mooncake calls,
  simulated) stops asking it: about two bounds in all, not one per key.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import kvmove
from kvmove import Status
from tests.support.staging_data import make_staging

pytestmark = pytest.mark.store

PAGE = 4
GEOMETRY = {"kv": (3, 656)}


def segmentless(store: kvmove.MooncakeStore, **fields) -> kvmove.MooncakeStore:
    """A second store on ``store``'s master with no segment of its own (its objects live in
    ``store``'s): a client of it that is replaced is closed, not kept for the segment."""
    return kvmove.MooncakeStore(kvmove.StoreConfig(
        master_address=store.address, local_hostname="127.0.0.1", global_segment_size=0,
        **fields))


@contextlib.contextmanager
def stopped(pid: int, safety_s: float = 8.0):
    """``pid`` stopped (SIGSTOP) for the block. A helper process resumes it after
    ``safety_s`` whatever happens: code that freezes this process (the GIL held while
    waiting for the stopped master) then ends, and the test fails instead of hanging."""
    os.kill(pid, signal.SIGSTOP)
    safety = subprocess.Popen([
        sys.executable, "-c",
        "import os, signal, sys, time; time.sleep(float(sys.argv[1])); "
        "os.kill(int(sys.argv[2]), signal.SIGCONT)", str(safety_s), str(pid)])
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
        safety.kill()
        safety.wait()


class Watchdog:
    """A thread that ticks every 10 ms: ``max_gap`` is the longest this process froze."""

    def __init__(self):
        self.ticks = [time.monotonic()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.ticks.append(time.monotonic())

    def stop(self) -> float:
        """Stop; the longest gap between ticks (up to now), in seconds."""
        self._stop.set()
        self._thread.join(5)
        ticks = [*self.ticks, time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(ticks))


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_replaced_client_is_closed_only_after_the_batch_using_it_ends(
        store, keyspace, monkeypatch, op):
    # 6 keys in chunks of 2: the client is replaced while the batch waits between its first
    # and second chunk, and the two chunks left still run on the first client.
    s = segmentless(store, max_batch_keys=2)
    staging = make_staging(GEOMETRY, num_slots=6, page_tokens=PAGE, seed=31)
    desc = kvmove.describe(staging, list(range(6)), keyspace(6))
    mid, go = threading.Event(), threading.Event()
    try:
        if op == "get":
            assert s.put(desc).all_ok
        first = s._state.client
        chunks: list = []  # the client each chunk ran on
        finished: list = []  # (client, chunks done) when its retirement closes it

        real_chunk = getattr(s, f"_{op}_chunk")

        def chunk(client, part, *args):
            codes = real_chunk(client, part, *args)
            chunks.append(client)
            if len(chunks) == 1:
                mid.set()
                assert go.wait(30)
            return codes

        real_finish = s._clients.finish_retired

        def finish(retired):
            finished.append((retired.client, len(chunks)))
            # Closing the client before the batch's last chunk would pull it from under
            # that chunk (a segfault): only recorded then, for the assertion below.
            if len(chunks) == 3:
                real_finish(retired)

        monkeypatch.setattr(s, f"_{op}_chunk", chunk)
        monkeypatch.setattr(s._clients, "finish_retired", finish)
        out: list = []
        batch = threading.Thread(target=lambda: out.append(getattr(s, op)(desc)))
        batch.start()
        assert mid.wait(30)
        s._replace_client(first)  # as after a call given up on it
        assert s._state.client is not first
        time.sleep(0.2)  # room for a close that would come too early
        assert finished == [], "the replaced client was retired while a batch used it"
        go.set()
        batch.join(30)
        assert out and out[0] == [Status.OK] * 6
        assert chunks == [first] * 3
        # Closed once the batch is done.
        assert wait_for(lambda: not s._state.retired)
        assert finished == [(first, 3)]
        monkeypatch.undo()
        assert s.get(desc).all_ok  # on the new client
    finally:
        go.set()
        s.close()


def test_open_against_a_stopped_master_raises_within_connect_timeout():
    with kvmove.EmbeddedMaster() as master:
        config = kvmove.StoreConfig(master_address=master.address, local_hostname="127.0.0.1",
                                    global_segment_size=0, connect_timeout=1.0)
        watchdog = Watchdog()
        with stopped(master.pid):
            t0 = time.monotonic()
            with pytest.raises(kvmove.StoreError,
                               match=rf"{re.escape(master.address)}: no answer .* within 1s"):
                kvmove.MooncakeStore(config)
            took = time.monotonic() - t0
        assert watchdog.stop() < 0.5  # no thread was frozen
        assert took < 2.0
        with kvmove.MooncakeStore(config) as s:  # it answers again
            assert s.exists(["nothing"]) == [False]


def test_replacement_is_postponed_while_the_master_does_not_answer(keyspace):
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb") as s:
        first = s._state.client
        watchdog = Watchdog()
        with stopped(s.master.pid):
            t0 = time.monotonic()
            replacing = threading.Thread(target=s._replace_client, args=(first,), daemon=True)
            replacing.start()  # as after a call given up
            replacing.join(10)
            took = time.monotonic() - t0
            assert not replacing.is_alive()
            assert s._state.client is first  # postponed: the client stays
        assert watchdog.stop() < 0.5
        assert took < 2.0  # the probe's bound: 1 s
        # The master answers again: the next attempt replaces the client, which works.
        s._replace_client(first)
        assert s._state.client is not first
        staging = make_staging(GEOMETRY, num_slots=2, page_tokens=PAGE, seed=32)
        desc = kvmove.describe(staging, [0, 1], keyspace(2))
        assert s.put(desc).all_ok and s.get(desc).all_ok


class Stalled:
    """A Mooncake call that waits for ``gate`` before it runs (a master that stopped
    answering), named like the call and bound to the same client."""

    def __init__(self, fn, gate: threading.Event, calls: list[str]):
        self.fn, self.gate, self.calls = fn, gate, calls
        self.__name__ = fn.__name__
        self.__self__ = fn.__self__

    def __call__(self, *args):
        self.calls.append(self.__name__)
        self.gate.wait(60)
        return self.fn(*args)


def test_a_get_stops_asking_a_master_that_stopped_answering(keyspace, monkeypatch):
    bound = 1.0
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", call_timeout=bound) as s:
        # 8 objects smaller than their destinations (the get answers -800 for each, and
        # then asks the master get_size to tell a size mismatch from a failure), between
        # two that read in full and one that is not stored.
        small = make_staging(GEOMETRY, num_slots=8, page_tokens=PAGE, seed=33)
        big = make_staging({"kv": (6, 1152)}, num_slots=11, page_tokens=PAGE, seed=34)
        small_keys, whole, missing = keyspace(8, "small"), keyspace(2, "whole"), "none"
        assert s.put(kvmove.describe(small, list(range(8)), small_keys)).all_ok
        assert s.put(kvmove.describe(big, [0, 9], whole)).all_ok
        desc = kvmove.describe(big, list(range(11)), [whole[0], *small_keys, whole[1],
                                                      missing])
        # The master stops answering once the get's data call has answered.
        gate, stalled = threading.Event(), []
        real = s._bounded

        def bounded(fn, *args, **kwargs):
            if fn.__name__ in ("get_size", "batch_is_exist", "batch_get_replica_desc"):
                fn = Stalled(fn, gate, stalled)
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(s, "_bounded", bounded)
        try:
            t0 = time.monotonic()
            result = s.get(desc)
            took = time.monotonic() - t0
        finally:
            gate.set()
        # Per key: the -800 keys are FAILED (their size unknown), the others unaffected.
        assert result == [Status.OK, *[Status.FAILED] * 8, Status.OK, Status.MISS]
        assert result.codes[1:9] == [-800] * 8
        # The failover's lease went unanswered (nothing more asked there), then the first
        # get_size did (no other key asked): two bounds, not one per key.
        assert stalled == ["batch_is_exist", "get_size"]
        assert took < 3 * bound, took
