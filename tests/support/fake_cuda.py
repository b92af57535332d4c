"""Stand-ins for CUDA streams, events and device guards on a machine without a GPU, to watch
what the mover orders on which stream and how its threads wait. Nothing is copied by them:
the copies themselves run on the CPU as usual; the stand-ins only log, in one list shared by
every thread, what was waited for, recorded and synchronised, and on which stream each copy
was enqueued.

- :class:`FakeCuda` installs the stand-ins (``torch.cuda.stream``, ``torch.cuda.Event``,
  ``torch.cuda.current_stream``) and gives a CPU :class:`kvmove.KVMover` an evict and a
  prefetch stream, and each call an event recorded on the caller's stream, as on CUDA.
- :class:`FakeDeviceGuard` is ``torch.cuda.device``'s logic (the device it replaced is kept
  on the guard object) over a per-thread current device.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeEvent:
    def __init__(self, cuda: FakeCuda, *, enable_timing=False, blocking=False,
                 interprocess=False):
        self.cuda, self.blocking = cuda, blocking
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else self.cuda.current()
        self.cuda.log.append(("record", self.stream.name, self))

    def synchronize(self) -> None:
        self.cuda.log.append(("event sync", threading.current_thread().name, self))

    def query(self) -> bool:
        return True

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.cuda.current()).wait_event(self)


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str):
        self.cuda, self.name = cuda, name

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event))

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(("wait stream", self.name, other))

    def synchronize(self) -> None:
        self.cuda.log.append(("stream sync", threading.current_thread().name, self.name))


class FakeCuda:
    """The stand-ins, installed with ``monkeypatch`` onto a CPU ``mover``. ``log`` holds
    ``(what, where, object)`` entries in the order they happened: ``"wait"`` / ``"record"``
    (stream name, event), ``"event sync"`` / ``"stream sync"`` (thread name, event or
    stream name), ``"copy"`` (stream name, "gather" or "scatter")."""

    def __init__(self, monkeypatch, mover):
        import kvmove.mover.staged_path as staged_path

        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.caller = FakeStream(self, "caller")
        self.calls: list[FakeEvent] = []  # each call's event on the caller's stream
        monkeypatch.setattr(torch.cuda, "stream", self._stream_context)
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(self, **kw))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current())
        # each direction's path runs its copies on its stream
        monkeypatch.setattr(mover._evict_path, "_stream", FakeStream(self, "evict"))
        monkeypatch.setattr(mover._prefetch_path, "_stream", FakeStream(self, "prefetch"))
        take = mover._requests.take

        def take_request(*args, **kwargs):
            request = take(*args, **kwargs)
            request.ordered = FakeEvent(self)
            request.ordered.record(self.caller)
            self.calls.append(request.ordered)
            return request

        monkeypatch.setattr(mover._requests, "take", take_request)
        for name, kind in (("copy_pages", "gather"), ("run_pages", "scatter")):
            monkeypatch.setattr(staged_path, name,
                                self._logged(getattr(staged_path, name), kind))

    def current(self) -> FakeStream:
        return getattr(self._local, "stream", self.caller)

    @contextlib.contextmanager
    def _stream_context(self, stream):
        before = self.current()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def _logged(self, fn, kind: str):
        def run(*args, **kwargs):
            self.log.append(("copy", self.current().name, kind))
            return fn(*args, **kwargs)

        return run

    def entries(self, what: str) -> list[tuple]:
        return [e for e in self.log if e[0] == what]


class FakeDeviceGuard:
    """``torch.cuda.device`` as torch writes it (``__enter__`` keeps the device it replaced
    on the object, ``__exit__`` restores it), over a per-thread current device."""

    current = threading.local()

    def __init__(self, device):
        self.idx = device.index if isinstance(device, torch.device) else int(device)
        self.prev_idx = -1

    @classmethod
    def exchange(cls, idx: int) -> int:
        before = getattr(cls.current, "idx", 0)
        cls.current.idx = idx
        return before

    @classmethod
    def current_device(cls) -> int:
        """``torch.cuda.current_device``: this thread's current device."""
        return getattr(cls.current, "idx", 0)

    def __enter__(self):
        self.prev_idx = self.exchange(self.idx)

    def __exit__(self, *exc) -> bool:
        self.idx = self.exchange(self.prev_idx)
        return False
