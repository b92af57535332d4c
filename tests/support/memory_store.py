"""An in-memory stand-in for :class:`kvmove.MooncakeStore`, for the GPU tests of the copy
and ordering path only: a GPU machine without Mooncake's CUDA wheel must still run every
mover test there (a check that skips them and says ok proves nothing). Everything else
tests against a real ``mooncake_master``; ``tests/store/test_memory_store.py`` runs one
sequence of calls against both and compares what they answer.

Same statuses and codes as ``MooncakeStore`` with its default config (``detect_exists``):
``put`` -> ``OK`` (0), ``EXISTS`` (-705, the stored object kept); ``get`` -> ``OK`` (the
object's size in bytes) when the described size is exactly the object's, ``MISS`` (-704),
``SIZE_MISMATCH`` (-600 for a smaller destination; a larger one is -800 with the object
present, which the store reports as ``SIZE_MISMATCH`` too); ``exists`` -> bools (codes 1 / 0);
``remove`` -> ``OK`` / ``MISS``. ``register`` / ``unregister`` keep the staging's regions;
``unregister`` refuses (``StoreError``) while a put or get is using them; raw regions and
the spans of raw descriptors are refused (``ValueError``) as the real store refuses them
(it copies with ctypes: memory that is not there would crash it too). Bytes are copied
from and to the descriptor's spans (host addresses of the staging) as Mooncake does.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter

from kvmove.errors import StoreError
from kvmove.memory.mapped import check_mapped
from kvmove.objects.descriptors import Descriptors
from kvmove.objects.span_check import check_spans
from kvmove.status import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    Status,
)
from kvmove.store.results import StoreResult


class MemoryStore:
    def __init__(self):
        self._objects: dict[str, bytes] = {}
        self._registered: dict[int, int] = {}
        self._in_use: Counter = Counter()
        self._lock = threading.Lock()
        self.closed = False
        self.calls: Counter = Counter()  # put / get / exists / remove / register / unregister

    transport = None  # it cannot read a KV cache's rows in place
    address = "memory"

    # -- memory -------------------------------------------------------------------------
    @staticmethod
    def _regions(staging) -> list[tuple[int, int]]:
        regions = staging.regions() if hasattr(staging, "regions") else staging
        return [(int(a), int(n)) for a, n in regions]

    def register(self, staging) -> None:
        self._open("register")
        self._add(staging)

    def _add(self, staging) -> None:
        """As ``MooncakeStore``: raw regions must be memory of this process (``ValueError``)."""
        regions = self._regions(staging)
        if not hasattr(staging, "regions"):
            check_mapped([r for r in regions if self._registered.get(r[0]) != r[1]])
        with self._lock:
            for address, nbytes in regions:
                self._registered[address] = nbytes

    def unregister(self, staging) -> None:
        self._open("unregister")
        regions = self._regions(staging)
        with self._lock:
            busy = [a for a, _ in regions if self._in_use[a]]
            if busy:
                raise StoreError(f"cannot unregister the staging region {busy[0]:#x}: "
                                 f"{self._in_use[busy[0]]} put/get call(s) in flight are "
                                 "using it (wait for the transfers to end first)")
            for address, _ in regions:
                self._registered.pop(address, None)

    def _use(self, desc: Descriptors, delta: int) -> list[int]:
        with self._lock:
            used = [a for a, n in self._registered.items()
                    if any(a <= p < a + n for ptrs in desc.ptrs for p in ptrs)]
            for a in used:
                self._in_use[a] += delta
        return used

    # -- calls --------------------------------------------------------------------------
    def put(self, desc: Descriptors, *, detect_exists: bool | None = None,
            until_returned: bool = False) -> StoreResult:
        """As ``MooncakeStore.put`` (whose default config asks): a stored key ends ``EXISTS``
        unless ``detect_exists=False``, then ``OK`` (code 0, as Mooncake answers); either
        way its object is kept."""
        detect_exists = detect_exists is not False
        self._open("put")
        self._check(desc)
        statuses, codes = [], []
        used = self._use(desc, +1)
        try:
            for key, ptrs, sizes in desc:
                with self._lock:
                    if key in self._objects:
                        statuses.append(Status.EXISTS if detect_exists else Status.OK)
                        codes.append(OBJECT_ALREADY_EXISTS if detect_exists else 0)
                        continue
                data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))
                with self._lock:
                    self._objects.setdefault(key, data)
                statuses.append(Status.OK)
                codes.append(0)
        finally:
            self._release(used)
        return StoreResult(statuses, codes)

    def get(self, desc: Descriptors, *, until_returned: bool = False) -> StoreResult:
        self._open("get")
        self._check(desc)
        statuses, codes = [], []
        used = self._use(desc, +1)
        try:
            for key, ptrs, sizes in desc:
                with self._lock:
                    data = self._objects.get(key)
                want = sum(sizes)
                if data is None:
                    statuses.append(Status.MISS)
                    codes.append(OBJECT_NOT_FOUND)
                elif len(data) != want:
                    statuses.append(Status.SIZE_MISMATCH)
                    codes.append(INVALID_PARAMS if want < len(data) else TRANSFER_FAIL)
                else:
                    at = 0
                    for p, n in zip(ptrs, sizes, strict=True):
                        ctypes.memmove(p, data[at:at + n], n)
                        at += n
                    statuses.append(Status.OK)
                    codes.append(want)
        finally:
            self._release(used)
        return StoreResult(statuses, codes)

    def begin_put(self, keys, *, detect_exists: bool | None = None) -> _PendingPut:
        """As ``MooncakeStore.begin_put``: its put is a put of the keys it was begun with."""
        self._open("begin_put")
        return _PendingPut(self, list(keys), detect_exists)

    def exists(self, keys) -> StoreResult:
        self._open("exists")
        with self._lock:
            found = [k in self._objects for k in keys]
        return StoreResult(found, [int(f) for f in found])

    def remove(self, keys, *, force: bool = False) -> StoreResult:
        self._open("remove")
        statuses = []
        with self._lock:
            for k in keys:
                statuses.append(Status.OK if self._objects.pop(k, None) is not None
                                else Status.MISS)
        return StoreResult(statuses, [0 if s is Status.OK else OBJECT_NOT_FOUND
                                      for s in statuses])

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------
    def _open(self, what: str) -> None:
        if self.closed:
            raise StoreError("the store is closed")
        self.calls[what] += 1

    def _check(self, desc) -> None:
        if not isinstance(desc, Descriptors):
            raise TypeError(f"expected kvmove.Descriptors (from describe()), got {type(desc)}")
        if not desc.vouched:  # as MooncakeStore: raw spans inside registered memory only
            self._add(desc.staging if desc.staging is not None else desc.regions)
            with self._lock:
                regions = list(self._registered.items())
            check_spans(desc.keys, desc.ptrs, desc.sizes, regions)

    def _release(self, used: list[int]) -> None:
        with self._lock:
            for a in used:
                self._in_use[a] -= 1
                if not self._in_use[a]:
                    del self._in_use[a]


class _PendingPut:
    def __init__(self, store: MemoryStore, keys: list[str], detect_exists: bool | None):
        self._store, self.keys, self._detect_exists = store, keys, detect_exists
        self._closed = False

    def put(self, desc: Descriptors) -> StoreResult:
        missing = next((k for k in desc.keys if k not in set(self.keys)), None)
        if missing is not None:
            raise ValueError(f"desc holds key {missing!r}, which this PendingPut was not "
                             f"begun with")
        if self._closed:
            raise StoreError("put() of a PendingPut that has ended")
        return self._store.put(desc, detect_exists=self._detect_exists)

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> _PendingPut:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
