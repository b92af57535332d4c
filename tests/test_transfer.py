"""kvmove.Transfer on its own: pieces joined in key order whatever order they finish in, a
bounded wait, layer progress in order, the CPU stand-ins for CUDA events."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from kvmove.status import Status
from kvmove.transfer import (
    CompletedEvent,
    LayerProgress,
    StageTimes,
    Transfer,
    TransferResult,
    join_results,
)

OK, MISS, FAILED = Status.OK, Status.MISS, Status.FAILED


def result(statuses, nbytes=0, put=0.0):
    return TransferResult(list(statuses), [0 if s is OK else -704 for s in statuses], nbytes,
                          StageTimes(put=put))


def test_pieces_are_joined_in_key_order():
    t = Transfer(["a", "b", "c", "d"], kind="evict", num_layers=2)
    late = Future()
    t.add_piece(2, late)
    t.add_piece(0, result([OK, MISS], nbytes=10, put=1.0))
    assert not t.done()
    late.set_result(result([FAILED, OK], nbytes=5, put=2.0))
    assert t.done()
    joined = t.result()
    assert joined.statuses == [OK, MISS, FAILED, OK] and t.wait() == joined.statuses
    assert joined.codes == [0, -704, -704, 0]
    assert joined.nbytes == 15 and joined.times.put == 3.0


def test_join_of_one_piece_is_that_piece():
    one = result([OK])
    assert join_results([one]) is one


def test_wait_is_bounded():
    t = Transfer(["a"], kind="prefetch", num_layers=1)
    t.add_piece(0, Future())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="prefetch of 1 keys still running"):
        t.wait(timeout=0.2)
    assert time.monotonic() - t0 < 5


def test_wait_layer_checks_its_argument():
    t = Transfer(["a"], kind="prefetch", num_layers=3)
    for bad in (-1, 3, True, "1"):
        with pytest.raises(IndexError, match=r"layer must be in 0\.\.2"):
            t.wait_layer(bad)
    with pytest.raises(TimeoutError, match="layer 1"):
        t.wait_layer(1, timeout=0.1)


def test_layers_complete_in_order_and_finish_releases_every_waiter():
    progress = LayerProgress(3)
    reached = []

    def waiter(layer):
        reached.append((layer, progress.wait(layer, 10)[0]))

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in (0, 2)]
    for th in threads:
        th.start()
    progress.layer_done()
    time.sleep(0.05)
    assert progress.reached(0) and not progress.reached(1) and not progress.reached(None)
    progress.finish()  # e.g. the transfer ended early: nobody waits forever
    for th in threads:
        th.join(10)
    assert sorted(reached) == [(0, True), (2, True)]


def test_all_done_covers_every_layer():
    progress = LayerProgress(4)
    progress.all_done()
    assert all(progress.reached(layer) for layer in range(4)) and progress.reached(None)


def test_cpu_events_are_complete():
    t = Transfer(["a"], kind="evict", num_layers=1)
    assert isinstance(t.gathered, CompletedEvent)
    assert t.gathered.query() and t.gathered.synchronize() is None
    t.progress.all_done()
    assert t.scattered.query()
    t.scattered.synchronize()
    t.scattered.wait()
