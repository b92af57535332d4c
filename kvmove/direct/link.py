"""``PeerLink``: a sender's line to one receiver — a Transfer Engine of its own and one
thread that makes its calls, one at a time, in the order the jobs came.

A call that fails, or that the watchdog timed out, breaks the link: the queued jobs end
``FAILED`` (``NOT_SENT``) at once, and the failed job ends (pages that landed ``OK``, the
rest ``FAILED``) and gives its slots back only once its call returned and the engine is
destroyed. The sender makes a new link for the next send to that receiver. The contract
is ``docs/API.md``, "Prefill -> decode host memory (direct transfer)".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial

from kvmove.direct.job import SendJob
from kvmove.errors import KVMoveError
from kvmove.status import CLIENT_EXCEPTION, NOT_SENT, WRITE_TIMEOUT, code_name
from kvmove.store.bounded_call import Watchdog
from kvmove.store.transfer_engine import Engine, TransportSettings

log = logging.getLogger(__name__)


class PeerLink:
    def __init__(self, peer: str, settings: TransportSettings, watchdog: Watchdog):
        self.peer = peer
        # One engine per receiver: one that stops answering at first contact holds its
        # engine for 60 s (Mooncake 0.3.13 handshakes under the engine's lock), and too many
        # spans in flight to one peer can break that connection for good; neither reaches
        # the sender's other receivers. One call at a time keeps a peer's spans in flight
        # at MAX_SPANS_PER_CALL.
        self.engine = Engine(settings.named_apart())
        self._watchdog = watchdog
        self._jobs: deque[SendJob] = deque()
        self._cond = threading.Condition()
        self._call: tuple[object, SendJob, bool] | None = None  # in flight: token, job,
        # whether it is the first contact (no span: the job's staging is not the engine's)
        self._contacted = False  # the first contact returned 0: the peer's segment is open
        self._broken = False
        self._closing = False
        self._finished = False
        self.broken_at = 0.0  # time.monotonic() when a call failed
        self.jobs_ok = 0  # jobs whose every call returned 0
        self.failed_before = 0  # links to this peer that broke in a row before this one
        self.abandoned = False  # a call timed out: its thread is left to end when it returns
        self._thread = threading.Thread(target=self._serve, name=f"kvmove-send {peer}",
                                        daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        with self._cond:
            return not (self._broken or self._closing)

    @property
    def finished(self) -> bool:
        """The link's thread has ended: its engine is destroyed."""
        with self._cond:
            return self._finished

    def submit(self, job: SendJob) -> bool:
        """Queue ``job``; False (nothing queued) when the link is broken or closing."""
        with self._cond:
            if self._broken or self._closing:
                return False
            self._jobs.append(job)
            self._cond.notify_all()
            return True

    def close(self) -> None:
        """Finish the queued jobs, then destroy the engine (on the link's thread)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Wait until the link's thread has ended (its engine destroyed) or the link was
        abandoned (its thread still waits on a call that did not return in time)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished or self.abandoned, timeout)

    def abandon(self, token: object) -> None:
        """The watchdog: call ``token`` has not returned in time. The queued jobs end
        ``FAILED`` (``NOT_SENT``) at once. The job of a first contact ends ``FAILED``
        (``WRITE_TIMEOUT``) and gives its slots back at once (none of its bytes were sent,
        the engine never got its staging); the job of a write of data ends (``WRITE_TIMEOUT``
        for the pages it had not landed) only once the call returned and the engine is
        destroyed: until then its bytes may still land."""
        with self._cond:
            if self._call is None or self._call[0] is not token:
                return  # it returned meanwhile
            _, job, contact = self._call
            self._broken = self.abandoned = True
            self.broken_at = time.monotonic()
            queued = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        if contact:
            log.warning("no answer from %s within %g s; its pages are FAILED", self.peer,
                        self._watchdog.timeout)
            job.finish(WRITE_TIMEOUT)
            job.release()
        else:
            log.warning("a write to %s has not returned within %g s; its pages end when it "
                        "does", self.peer, self._watchdog.timeout)
        _fail(queued)

    # -- the link's thread ----------------------------------------------------------------
    def _serve(self) -> None:
        failed = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing or self._broken)
                if self._broken or not self._jobs:
                    break
                job = self._jobs.popleft()
            try:
                why = self._run(job)
            except Exception:  # a broken contract (a CUDA error, a binding's TypeError)
                log.exception("sending to %s failed", self.peer)
                why = CLIENT_EXCEPTION, 0.0
            if why is not None:
                failed = job
                break
            self.jobs_ok += 1
            job.release()
        with self._cond:
            if failed is not None and not self.broken_at:
                self.broken_at = time.monotonic()
            self._broken = True
            queued = list(self._jobs)
            self._jobs.clear()
        _fail(queued)
        self.engine.close()  # nothing reads the staging, or writes the peer, after this
        if failed is not None:
            failed.finish(*why)  # only now: none of its bytes can land after FAILED
            failed.release()
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _watched(self, job: SendJob, contact: bool, srcs, dsts, lengths) -> tuple[int, bool]:
        """One write under the watchdog: its code and whether the watchdog timed it out."""
        token = object()
        with self._cond:
            self._call = (token, job, contact)
        self._watchdog.arm(token, partial(self.abandon, token))
        try:
            rc = self.engine.write(self.peer, srcs, dsts, lengths)
        finally:
            self._watchdog.disarm(token)
            with self._cond:
                self._call = None
                abandoned = self.abandoned
        return rc, abandoned

    def _contact(self, job: SendJob) -> bool:
        """First contact with the peer, for ``job``: a write of no span. False when the
        watchdog timed it out: then ``job`` is ``FAILED`` and its slots are back. A contact
        that returns an error in time proves nothing about the peer (a transport may refuse
        a write of no span): the job's own write goes ahead and fails or lands as it would
        have without one."""
        # A receiver stopped before first contact holds the handshake for a minute, the one
        # wait Mooncake does not bound itself; inside the job's write it would hold slots
        # shared by every receiver. Mooncake opens (and caches) the peer's segment before it
        # looks at the spans, so an empty write does the handshake under the watchdog before
        # the job's staging is registered: a contact that timed out frees its slots at once.
        # Freeing a timed-out write of data at once would be unsafe (a call stuck in the
        # handshake cannot be told from one reading the staging), and a share of the slots
        # per receiver would cap a sender with one receiver. The cost: one empty call per
        # engine, a fraction of a millisecond on loopback.
        rc, abandoned = self._watched(job, True, [], [], [])
        if not abandoned:
            if rc != 0:
                log.debug("first contact with %s returned %d (%s); writing anyway",
                          self.peer, rc, code_name(rc))
            self._contacted = True
            return True
        job.finish(WRITE_TIMEOUT)
        job.release()  # the engine never got its staging
        return False

    def _run(self, job: SendJob) -> tuple[int, float] | None:
        """Make the job's calls (after first contact, if not made yet). None when every
        one returned 0 (the job has ended ``OK``); else the code and write time the job is
        to end with once the engine is destroyed (the pages its calls that returned 0
        landed ``OK``, the rest ``FAILED``)."""
        if not self._contacted and not self._contact(job):
            return WRITE_TIMEOUT, 0.0  # the job has ended already
        try:
            self.engine.register(job.regions)
        except KVMoveError as e:
            log.warning("sending to %s: %s", self.peer, e)
            return CLIENT_EXCEPTION, 0.0
        if job.gathered is not None:
            job.gathered.synchronize()
        # After contact, a receiver that stops answering fails a write within
        # MC_TRANSFER_TIMEOUT (5 s, measured over TCP); the sender's call_timeout exceeds
        # that, so the watchdog times out a write of data only when Mooncake overran it.
        t0 = time.perf_counter()
        for k in range(job.plan.num_calls):
            rc, abandoned = self._watched(job, False, *job.plan.call(k))
            if rc == 0:
                job.calls_ok = k + 1  # landed, even after it timed out
            if rc != 0 or abandoned:
                if not abandoned:
                    log.warning("a write of %d spans to %s failed (%d, %s); its pages are "
                                "FAILED", len(job.plan.call(k)[2]), self.peer, rc,
                                code_name(rc))
                return (WRITE_TIMEOUT if abandoned else rc), time.perf_counter() - t0
        job.finish(None, time.perf_counter() - t0)
        return None

    def __repr__(self) -> str:
        state = ("abandoned" if self.abandoned else "finished" if self._finished
                 else "broken" if self._broken else "closing" if self._closing else "open")
        return f"PeerLink({self.peer}, {state})"


def _fail(jobs: list[SendJob]) -> None:
    """End jobs that never reached the engine: ``FAILED`` (``NOT_SENT``), slots back."""
    for job in jobs:
        job.finish(NOT_SENT)
        job.release()
