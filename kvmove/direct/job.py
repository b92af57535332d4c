"""``SendJob``: one piece of a send on its way to a receiver — the calls it makes (its
:class:`~kvmove.direct.spans.SpanPlan`), the staging slots it reads, and the future of its
per-page result."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from kvmove.direct.slots import LayerSlots
from kvmove.direct.spans import SpanPlan
from kvmove.metrics import record as metrics
from kvmove.mover.transfer import StageTimes, TransferResult
from kvmove.status import Status


class SendJob:
    """``future`` ends with one status per page (``OK`` or ``FAILED``, raw code 0 or why)
    once :meth:`finish` is called, by the thread making the calls or by the watchdog that
    timed them out, whichever comes first. The slots go back to ``slots`` on
    :meth:`release`, which the caller makes only once no engine can read them any more.
    ``keep`` holds what the spans point into (the staging) alive until then."""

    def __init__(self, plan: SpanPlan, slots: np.ndarray, layer: int | None,
                 allocator: LayerSlots, *, regions, gathered, gather_s: float, keep):
        self.plan = plan
        self.regions = regions  # the staging's (address, nbytes): what the engine reads
        self.gathered = gathered  # CUDA event after the gather, or None
        self.future: Future = Future()
        self.calls_ok = 0  # calls that have returned 0 so far
        self._slots, self._layer, self._allocator = slots, layer, allocator
        self._gather_s = gather_s
        self._keep = keep
        self._lock = threading.Lock()
        self._released = False

    @property
    def num_pages(self) -> int:
        return int(self.plan.page_bytes.size)

    def finish(self, code: int | None, write_s: float = 0.0) -> None:
        """Set the result (once; later calls do nothing): every page ``OK`` when ``code`` is
        None, else the pages wholly written by the calls that returned 0 ``OK`` and the
        others ``FAILED`` with ``code``."""
        with self._lock:
            if self.future.done():
                return
            n = self.num_pages
            landed = np.ones(n, dtype=bool) if code is None else self.plan.landed(self.calls_ok)
            statuses = [Status.OK if ok else Status.FAILED for ok in landed.tolist()]
            codes = [0 if ok else code for ok in landed.tolist()]
            nbytes = int(self.plan.page_bytes[landed].sum())
            result = TransferResult(statuses, codes, nbytes,
                                    StageTimes(gather=self._gather_s, put=write_s))
            metrics.result("send", result)
            self.future.set_result(result)

    def release(self) -> None:
        """Give the slots back (once)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._allocator.free(self._slots, self._layer)
        self._keep = None
