"""What the mover orders and how its threads wait, watched on the CPU through stand-in
streams and events (:mod:`tests.support.fake_cuda`): the copies themselves run on the CPU,
the stand-ins log every wait, record and synchronisation. The GPU tests
(``tests/gpu/test_mover_streams.py``) check the same on a device.

- Every piece of a prefetch larger than the staging waits for the caller's stream before
  its scatter reads the caller's indices, also when an earlier piece scattered nothing.
- The mover's worker threads sleep on blocking events; they never spin on a stream or on a
  spinning event next to the engine's scheduler thread (item 8).
- ``wait_layer`` raises what the prefetch raised; it never returns as if the layer were in
  place when the job failed, however the wake-up and the failure interleave (item 8).
"""

from __future__ import annotations

import time

import pytest
import torch

import kvmove
from kvmove.mover import transfer as transfer_module
from tests.support.fake_cuda import FakeCuda

pytestmark = pytest.mark.store

PT = 4


def make_mover(store, slots: int = 2) -> kvmove.KVMover:
    g = torch.Generator().manual_seed(3)
    layers = torch.randint(0, 256, (3, 64, 132), dtype=torch.uint8, generator=g)
    return kvmove.KVMover(kvmove.KVCache({"kv": layers}), store, page_tokens=PT,
                          staging_slots=slots)


def pages(first: int, n: int) -> torch.Tensor:
    return torch.arange(first * PT, (first + n) * PT).reshape(n, PT)


def test_every_prefetch_piece_waits_for_the_callers_stream(store, keyspace, monkeypatch):
    """A prefetch of 5 keys through 2 staging slots runs in 3 pieces; the first piece's keys
    all miss, so it scatters nothing. Each later piece's scatter reads the caller's index
    tensors (on CUDA written on the caller's stream), so the prefetch stream must have
    waited for the caller's event before it: the first piece, which used to be the only
    one given the event, never waited."""
    with make_mover(store) as mover:
        keys = keyspace(5)
        assert mover.evict(keys[2:], pages(0, 3)).wait(30) == [kvmove.Status.OK] * 3
        cuda = FakeCuda(monkeypatch, mover)
        t = mover.prefetch(keys, pages(8, 5))
        assert t.wait(30) == [kvmove.Status.MISS] * 2 + [kvmove.Status.OK] * 3
    [ordered] = cuda.calls
    waited = False
    scatters = 0
    for what, where, obj in cuda.log:
        if what == "wait" and where == "prefetch" and obj is ordered:
            waited = True
        elif what == "copy" and where == "prefetch":
            scatters += 1
            assert waited, "a scatter ran on the prefetch stream before it waited for the " \
                           "caller's stream"
    assert scatters == 2  # the pieces [k2, k3] and [k4]
    expect = mover.kv.layer("kv", 0)[pages(0, 3).reshape(-1)]
    assert torch.equal(mover.kv.layer("kv", 0)[pages(8, 5)[2:].reshape(-1)], expect)


def test_worker_threads_sleep_on_blocking_events_never_spin(store, keyspace, monkeypatch):
    """A CUDA event made without ``blocking=True`` (``cudaEventBlockingSync``) and a stream's
    ``synchronize()`` busy-wait on a core: two workers spinning beside an engine's
    scheduler thread steal its CPU. Every wait of a worker is on a blocking event."""
    with make_mover(store, slots=4) as mover:
        cuda = FakeCuda(monkeypatch, mover)
        keys = keyspace(3)
        assert mover.evict(keys, pages(0, 3)).wait(30) == [kvmove.Status.OK] * 3
        p = mover.prefetch(keys, pages(8, 3))
        assert p.wait(30) == [kvmove.Status.OK] * 3
        lw = mover.prefetch(keys, pages(12, 3), layerwise=True)
        assert lw.wait(30) == [kvmove.Status.OK] * 3
    assert cuda.entries("stream sync") == [], "a worker spun on stream.synchronize()"
    syncs = cuda.entries("event sync")
    assert len(syncs) >= 3  # the put waits for the gather; each prefetch for its scatter
    for _, thread, event in syncs:
        assert thread.startswith("kvmove"), f"{thread} synchronised (not a worker)"
        assert event.blocking, f"{thread} spins on a non-blocking event"


def test_wait_layer_raises_what_the_prefetch_raised(store, keyspace, monkeypatch):
    """The job wakes the waiters in its ``finally`` (``LayerProgress.finish``) before its
    future holds the exception. The stand-in ``finish`` holds the worker there a while after
    the wake-up, so the waiter surely looks at the future before it is set: it must still
    raise, not return as if layer 0 were in the KV cache."""
    real_finish = transfer_module.LayerProgress.finish

    def slow_finish(self):
        real_finish(self)
        time.sleep(0.3)

    monkeypatch.setattr(transfer_module.LayerProgress, "finish", slow_finish)
    with make_mover(store) as mover:
        keys = keyspace(2)
        assert mover.evict(keys, pages(0, 2)).wait(30) == [kvmove.Status.OK] * 2
        before = mover.kv.layer("kv", 0).clone()

        def broken_scatter(*args, **kwargs):
            raise RuntimeError("scatter failed")

        monkeypatch.setattr(mover._prefetch_path, "_scatter", broken_scatter)
        t = mover.prefetch(keys, pages(8, 2), layerwise=True)
        with pytest.raises(RuntimeError, match="scatter failed"):
            t.wait_layer(0, timeout=30)
        with pytest.raises(RuntimeError, match="scatter failed"):
            t.wait(30)
        assert torch.equal(mover.kv.layer("kv", 0), before)


def test_layer_progress_tells_a_finished_job_from_a_placed_layer():
    progress = transfer_module.LayerProgress(3)
    progress.layers_done(1)
    progress.finish()  # the job failed after layer 0
    assert progress.wait(2, 1)[0]  # woken
    assert progress.layer_in_place(0) and not progress.layer_in_place(1)
    assert not progress.layer_in_place(None)
    progress.all_done()
    assert progress.layer_in_place(None) and progress.layer_in_place(2)


def test_pieces_share_the_callers_event(store, keyspace, monkeypatch):
    """An evict in pieces: every gather waits for the caller's event (one event per call,
    recorded once on the caller's stream), and the gathers run on the evict stream."""
    with make_mover(store) as mover:
        cuda = FakeCuda(monkeypatch, mover)
        keys = keyspace(5)
        assert mover.evict(keys, pages(0, 5)).wait(30) == [kvmove.Status.OK] * 5
    [ordered] = cuda.calls
    gathers = [i for i, e in enumerate(cuda.log) if e[0] == "copy"]
    assert [cuda.log[i][1] for i in gathers] == ["evict"] * 3
    waits = [i for i, e in enumerate(cuda.log) if e[0] == "wait" and e[2] is ordered]
    assert len(waits) == 3 and all(w < g for w, g in zip(waits, gathers, strict=True))
