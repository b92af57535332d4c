"""What a mover's calls share while it lives: its worker threads, the transfers running on
callers' threads, the memory held for store calls that timed out and are still in flight,
its totals, and ``close()`` (``docs/API.md``, "KVMover" and "Clusters")."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvmove.errors import KVMoveError
from kvmove.memory.staging import StagingBuffer
from kvmove.metrics import record as metrics
from kvmove.mover.job_threads import JobThreads
from kvmove.mover.transfer import StealableJob, TransferResult
from kvmove.status import Status
from kvmove.store.protocol import Store

log = logging.getLogger(__name__)


@dataclass
class MoverStats:
    """Totals since the mover was created (thread-safe snapshot via ``KVMover.stats()``)."""

    evicts: int = 0
    prefetches: int = 0
    pages_put: int = 0
    pages_got: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    gather_s: float = 0.0
    put_s: float = 0.0
    get_s: float = 0.0
    scatter_s: float = 0.0
    statuses: dict | None = None  # Status -> count


class Lifecycle:
    """The shared state of one mover's calls. ``release`` unregisters and frees the
    mover's memory: :meth:`close` tells its caller to run it, or, where store calls that
    timed out still use that memory, the last of them runs it when it returns."""

    def __init__(self, workers: int, staging: StagingBuffer, store: Store,
                 release: Callable[[], None]):
        self.lock = threading.Lock()
        self.closed = False
        self._staging, self._store, self._release = staging, store, release
        self._inline = 0  # transfers running on callers' threads
        self._inline_done = threading.Condition(self.lock)
        self._stats = MoverStats(statuses={s: 0 for s in Status})
        self.held_slots = 0  # staging slots held for store calls in flight (free_after)
        # Store keys of in-place puts that timed out whose Mooncake call is still in
        # flight (hold_keys): a new put of one is not sent meanwhile.
        self.held_keys: set[str] = set()
        self.executor = JobThreads(workers, "kvmove")
        # Puts never wait for slots; prefetch jobs do: on one pool, prefetches waiting for
        # slots could hold every worker while the puts that free them wait in the queue.
        self.put_executor = JobThreads(workers, "kvmove-put")

    # -- jobs -------------------------------------------------------------------------------
    def submit(self, fn, *args, put: bool = False) -> Future:
        """Queue ``fn(*args)`` as a background job (on the put workers with ``put``),
        unless the mover was closed meanwhile (``KVMoveError``: the caller frees its
        slots)."""
        with self.lock:
            if self.closed:
                raise KVMoveError("the KVMover is closed")
            return (self.put_executor if put else self.executor).submit(fn, *args)

    def start(self, job: StealableJob) -> None:
        """:meth:`submit` of a job that reports its own result: queued as it is, with no
        second future around it, and without the mover's lock: a job queued before the
        workers' shutdown runs before ``close()`` returns, one after it is refused."""
        if self.closed:
            raise KVMoveError("the KVMover is closed")
        try:
            self.executor.start(job)
        except RuntimeError:  # shut down meanwhile
            raise KVMoveError("the KVMover is closed") from None

    @contextlib.contextmanager
    def inline_run(self):
        """Count a transfer that runs on a caller's thread (``close()`` waits for them);
        yields False, counting nothing, once the mover is closed."""
        with self.lock:
            allowed = not self.closed
            self._inline += allowed
        try:
            yield allowed
        finally:
            if allowed:
                with self._inline_done:
                    self._inline -= 1
                    self._inline_done.notify_all()

    # -- totals -----------------------------------------------------------------------------
    def count(self, result: TransferResult, *, put: bool) -> None:
        with self.lock:
            s = self._stats
            ok = result.statuses.count(Status.OK)
            if put:
                s.evicts += 1
                s.pages_put += ok
                s.bytes_put += result.nbytes
                s.gather_s += result.times.gather
                s.put_s += result.times.put
            else:
                s.prefetches += 1
                s.pages_got += ok
                s.bytes_got += result.nbytes
                s.get_s += result.times.get
                s.scatter_s += result.times.scatter
            if ok == len(result.statuses):  # the usual case, without a pass per key
                s.statuses[Status.OK] += ok
            else:
                for st, k in Counter(result.statuses).items():
                    s.statuses[st] += k
        metrics.result("evict" if put else "prefetch", result)

    def stats(self) -> MoverStats:
        with self.lock:
            s = self._stats
            return MoverStats(**{**s.__dict__, "statuses": dict(s.statuses)})

    # -- memory of store calls still in flight ---------------------------------------------
    def free_after(self, slots: torch.Tensor, in_flight) -> None:
        """Return ``slots`` to the staging, at once or, when a store call on them timed
        out (``in_flight``: its future), only once that call has really returned: until
        then Mooncake may still write into (get) or read from (put) their memory."""
        if in_flight is None or in_flight.done():
            self._staging.free(slots)
            return
        with self.lock:
            self.held_slots += len(slots)
        log.warning("%d staging slots held until a store call that timed out on them "
                    "returns", len(slots))
        in_flight.add_done_callback(lambda _f: self._slots_returned(slots))

    def _slots_returned(self, slots: torch.Tensor) -> None:
        self._staging.free(slots)
        with self.lock:
            self.held_slots -= len(slots)
            last = self.closed and self.held_slots == 0 and not self.held_keys
        if last:
            self._release()

    def hold_keys(self, late_stored, keys: list[str]) -> None:
        """An in-place put that timed out still reads the KV rows until Mooncake returns,
        and the engine may have written them meanwhile (its evict ended FAILED): once the
        call has returned, remove what it stored after all (``late_stored``; never a key
        it did not store: that may hold a good object of an earlier put), so no key holds
        bytes of two moments. Until then a new in-place put of ``keys`` is not sent (it
        ends FAILED), and the KV rows stay registered. ``keys`` is never empty and never
        shares a key with another held put's."""
        with self.lock:
            self.held_keys.update(keys)

        def remove(future) -> None:
            stored = future.result()
            try:
                if stored:
                    self._store.remove(stored, force=True)
            except Exception as e:  # the store may be closed by then
                log.warning("removing %d keys of an in-place put that timed out failed: %s",
                            len(stored), e)
            finally:
                with self.lock:
                    self.held_keys.difference_update(keys)
                    last = self.closed and self.held_slots == 0 and not self.held_keys
                if last:  # close() left the release to the last call in flight
                    self._release()

        late_stored.add_done_callback(remove)

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> bool:
        """Refuse new calls and wait for every transfer to end. True where the caller
        releases the memory now (the first close, with no store call in flight on it)."""
        with self.lock:
            first, self.closed = not self.closed, True
        self.executor.shutdown(wait=True)
        self.put_executor.shutdown(wait=True)
        with self._inline_done:  # transfers on callers' threads
            self._inline_done.wait_for(lambda: self._inline == 0)
        if not first:
            return False
        with self.lock:
            slots, keys = self.held_slots, len(self.held_keys)
        if slots or keys:  # the last store call in flight releases it all when it returns
            log.warning("closing the mover: %d staging slots and the KV rows of %d keys of "
                        "in-place puts that timed out stay registered until their store "
                        "calls return (Mooncake's cap is 60 s)", slots, keys)
            return False
        return True

    def abandon(self) -> None:
        """Stop the workers of a mover that failed to build (no job was queued)."""
        for pool in (self.executor, self.put_executor):
            pool.shutdown(wait=False)
