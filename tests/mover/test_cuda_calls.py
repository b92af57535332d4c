"""How many CUDA calls an ``evict``, a ``prefetch`` and a ``wait_layer`` make on the caller's
thread, counted on the CPU: the mover is given stand-in streams (its request taker, both
paths), so that the code it runs is its CUDA code path, and torch's CUDA entry points it
calls (``torch.cuda.Event``, ``current_stream``, ``stream``) are recording stand-ins. The
copies run on the CPU; each is counted as what the CUDA path enqueues for it: one upload of
host indices per planned copy and one launch per buffer. Device-resident indices (their
range check and host copies) need a GPU: ``tests/gpu``.

Driver calls are those that reach the CUDA driver (an event record, a stream's wait, an
upload, a launch, a synchronisation); the others (making an event object, looking up the
current stream, entering a stream context) are torch bookkeeping, counted apart.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import pytest
import torch

import kvmove
from kvmove.mover import staged_path

pytestmark = pytest.mark.store

PT = 4
LAYERS = 5
DRIVER = {"record", "wait_event", "upload", "launch", "event sync", "stream sync"}
GOAL = 4  # record the caller's event, the copy stream waits on it, one launch, one event


class _Event:
    def __init__(self, calls: CallLog, **_options):
        self.calls = calls
        calls.add("Event()")

    def record(self, stream=None) -> None:
        self.calls.add("record")

    def synchronize(self) -> None:
        self.calls.add("event sync")

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        self.calls.add("wait_event")


class _Stream:
    def __init__(self, calls: CallLog):
        self.calls = calls

    def wait_event(self, event) -> None:
        self.calls.add("wait_event")

    def wait_stream(self, other) -> None:
        self.calls.add("wait_event")

    def synchronize(self) -> None:
        self.calls.add("stream sync")

    def record_event(self, event=None):
        event = event if event is not None else _Event(self.calls)
        event.record(self)
        return event


class CallLog:
    """The calls made on one thread (the test's: the engine's caller thread)."""

    def __init__(self, monkeypatch, mover: kvmove.KVMover):
        self.thread = threading.get_ident()
        self.counts: Counter = Counter()
        caller = _Stream(self)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _Event(self, **kw))
        monkeypatch.setattr(torch.cuda, "current_stream", self._current(caller))
        monkeypatch.setattr(torch.cuda, "stream", self._stream_context)
        evict, prefetch = _Stream(self), _Stream(self)
        # the mover's CUDA code path: the taker records the caller's event, the paths
        # enqueue on their streams
        monkeypatch.setattr(mover._requests, "evict_stream", evict)
        monkeypatch.setattr(mover._requests, "prefetch_stream", prefetch)
        monkeypatch.setattr(mover._evict_path, "_stream", evict)
        monkeypatch.setattr(mover._prefetch_path, "_stream", prefetch)
        parts = len(mover.kv.buffer_names)
        for name, uploads, launches in (("copy_pages", 1, parts), ("plan_pages", 1, 0),
                                        ("run_pages", 0, parts)):
            monkeypatch.setattr(staged_path, name,
                                self._copy(getattr(staged_path, name), uploads, launches))

    def add(self, what: str, n: int = 1) -> None:
        if threading.get_ident() == self.thread and n:
            self.counts[what] += n

    def _current(self, caller: _Stream):
        def current_stream(device=None):
            self.add("current_stream")
            return caller
        return current_stream

    @contextlib.contextmanager
    def _stream_context(self, stream):
        self.add("stream()")
        yield

    def _copy(self, fn, uploads: int, launches: int):
        def copy(*args, **kwargs):
            self.add("upload", uploads)  # the call's host indices, as the CUDA path plans
            self.add("launch", launches)
            return fn(*args, **kwargs)
        return copy

    def take(self) -> tuple[int, dict]:
        """(driver calls, every call by name) since the last ``take``."""
        counts, self.counts = dict(self.counts), Counter()
        return sum(n for what, n in counts.items() if what in DRIVER), counts


def make_mover(store, buffers: int = 1) -> kvmove.KVMover:
    g = torch.Generator().manual_seed(5)
    names = ("kv", "indexer")[:buffers]
    kv = kvmove.KVCache({name: torch.randint(0, 256, (LAYERS, 64, 132 + 524 * i),
                                             dtype=torch.uint8, generator=g)
                         for i, name in enumerate(names)})
    return kvmove.KVMover(kv, store, page_tokens=PT, staging_slots=8, path="staged")


def pages(first: int, n: int) -> torch.Tensor:
    return torch.arange(first * PT, (first + n) * PT).reshape(n, PT)


def test_prefetch_and_wait_layer_make_at_most_four_cuda_calls(store, keyspace, monkeypatch):
    """The caller's thread of a prefetch records the caller's event and returns (the get and
    the scatter run on a worker); a ``wait_layer`` makes the caller's stream wait on the
    layer's event. The bytes land where they were asked to."""
    with make_mover(store) as mover:
        keys = keyspace(3)
        assert mover.evict(keys, pages(0, 3)).wait(30) == [kvmove.Status.OK] * 3
        calls = CallLog(monkeypatch, mover)
        for layerwise in (False, True):
            t = mover.prefetch(keys, pages(8 + 4 * layerwise, 3), layerwise=layerwise)
            driver, named = calls.take()
            assert driver <= GOAL, named
            assert named == {"current_stream": 1, "Event()": 1, "record": 1}
            if layerwise:
                for layer in range(LAYERS):
                    t.wait_layer(layer, timeout=30)
                    driver, named = calls.take()
                    assert driver <= GOAL and named == {"current_stream": 1,
                                                        "wait_event": 1}, named
            assert t.wait(30) == [kvmove.Status.OK] * 3
            calls.take()  # a whole wait() may run the job here: not the call's cost
            got = mover.kv.layer("kv", LAYERS - 1)[pages(8 + 4 * layerwise, 3).reshape(-1)]
            assert torch.equal(got, mover.kv.layer("kv", LAYERS - 1)[pages(0, 3).reshape(-1)])


@pytest.mark.parametrize("buffers", [1, 2])
def test_evict_cuda_calls(store, keyspace, monkeypatch, buffers):
    """An evict enqueues its gather on the caller's thread: the caller's event, the evict
    stream's wait on it, the indices' upload, one launch per buffer, the gathered event.
    Its put runs on a worker. The objects hold the rows gathered."""
    with make_mover(store, buffers) as mover:
        calls = CallLog(monkeypatch, mover)
        keys = keyspace(3)
        t = mover.evict(keys, pages(2, 3))
        driver, named = calls.take()
        assert named == {"current_stream": 1, "Event()": 2, "record": 2, "stream()": 1,
                         "wait_event": 1, "upload": 1, "launch": buffers}, named
        assert driver == 4 + buffers
        assert t.wait(30) == [kvmove.Status.OK] * 3
        before = mover.kv.layer("kv", 1)[pages(2, 3).reshape(-1)].clone()
        p = mover.prefetch(keys, pages(9, 3))
        assert p.wait(30) == [kvmove.Status.OK] * 3
        assert torch.equal(mover.kv.layer("kv", 1)[pages(9, 3).reshape(-1)], before)


@pytest.mark.xfail(strict=True, reason="the evict's indices are uploaded by a copy of "
                   "their own: at most 4 calls once the kernel reads them from a pinned "
                   "ring (kvmove/rows planning)")
def test_evict_makes_at_most_four_cuda_calls(store, keyspace, monkeypatch):
    with make_mover(store) as mover:
        calls = CallLog(monkeypatch, mover)
        t = mover.evict(keyspace(2), pages(0, 2))
        driver, named = calls.take()
        assert t.wait(30) == [kvmove.Status.OK] * 2
        assert driver <= GOAL, named


# -- on a GPU (unverified here: written on a machine without one) --------------------------
API = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
       "cudaEventRecord", "cudaEventRecordWithFlags", "cudaStreamWaitEvent",
       "cudaMemcpyAsync", "cudaEventSynchronize", "cudaStreamSynchronize", "cudaEventQuery"}


def _gpu_calls(fn) -> tuple[object, list[str]]:
    """``fn()`` under torch's profiler: what it returned and the CUDA runtime and driver
    calls made meanwhile on this thread (every thread's where the profiler does not tell)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
    events = [e for e in prof.events() if e.name in API]
    tid = threading.get_native_id()
    mine = [e for e in events if getattr(e, "thread", None) == tid]
    return out, [e.name for e in (mine or events)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_each_call_makes_at_most_four_cuda_calls(store, keyspace):
    """The same counts from the CUDA runtime and driver themselves: ``prefetch`` and
    ``wait_layer`` at most 4 on the caller's thread (host and device indices), ``evict``
    listed (its goal: ``test_evict_makes_at_most_four_cuda_calls``)."""
    cuda = torch.device("cuda")
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (LAYERS, 256, 656), dtype=torch.uint8,
                                             device=cuda)})
    with kvmove.KVMover(kv, store, page_tokens=PT, staging_slots=16, path="staged") as mover:
        keys = keyspace(4)
        assert mover.evict(keys, pages(0, 4)).wait(60) == [kvmove.Status.OK] * 4
        for dest in (pages(20, 4), pages(30, 4).to(cuda)):
            mover.prefetch(keys, dest, layerwise=True).wait(60)  # warm
            t, calls = _gpu_calls(lambda dest=dest: mover.prefetch(keys, dest,
                                                                   layerwise=True))
            assert len(calls) <= GOAL, calls
            for layer in range(LAYERS):
                _, calls = _gpu_calls(lambda t=t, layer=layer: t.wait_layer(layer, timeout=60))
                assert len(calls) <= GOAL, (layer, calls)
            assert t.wait(60) == [kvmove.Status.OK] * 4
        _, calls = _gpu_calls(lambda: mover.evict(keyspace(2, "e"), pages(8, 2)))
        print("evict's CUDA calls on the caller's thread:", calls)
