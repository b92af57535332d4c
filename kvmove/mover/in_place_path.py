"""The in-place path: the store reads (evict) and writes (prefetch) the KV rows where they
are (:class:`kvmove.objects.in_place.InPlaceRows`), with no staging copy. The contract is
``docs/API.md``, "The in-place path"."""

from __future__ import annotations

import logging
import time
from functools import partial

import numpy as np
import torch

from kvmove.errors import KVMoveError
from kvmove.mover.lifecycle import Lifecycle
from kvmove.mover.outcomes import fail_bad, ok_bytes, store_call, stored_keys
from kvmove.mover.request import Request
from kvmove.mover.transfer import (
    FutureEvent,
    LayerProgress,
    StageTimes,
    StealableJob,
    Transfer,
    TransferResult,
)
from kvmove.objects.in_place import InPlaceRows
from kvmove.objects.keys import KeySpace, RawKeys
from kvmove.status import BAD_ROWS, CALL_TIMEOUT, Status
from kvmove.store.bounded_call import wait_until_returned
from kvmove.store.protocol import Store

log = logging.getLogger(__name__)

# A store call that returns only once Mooncake has (a call that timed out included): for
# work whose rows go back to the engine only when it ends anyway (see the users).
_UNTIL_RETURNED = {"until_returned": True}


class _InPlace:
    """What both in-place directions share."""

    def __init__(self, *, rows: InPlaceRows, keyspace: KeySpace | RawKeys, store: Store,
                 life: Lifecycle, stream, num_slots: int):
        self.rows, self.keyspace, self.store, self._life = rows, keyspace, store, life
        self._stream = stream  # CUDA: the direction's stream; None on the CPU
        self._num_slots = num_slots  # the KV cache's

    def _host_pages(self, request: Request) -> tuple[np.ndarray, np.ndarray | None]:
        """The call's pages on the host and its keys with an out-of-range row (or None). On
        CUDA this first waits, on the direction's stream, for the caller's work at call
        time (which wrote the rows and the indices), then reads the indices: in the
        background, never on the caller's thread."""
        pages = request.pages
        if isinstance(pages, np.ndarray):  # host indices, copied (and checked) at call time
            if request.ordered is not None:  # device rows: the caller's work wrote them
                request.ordered.synchronize()
            return pages, request.bad
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(request.ordered)
            pages = pages.to("cpu")
        stream.synchronize()
        host = pages.numpy()
        out = ((host < -1) | (host >= self._num_slots)).any(axis=1)
        return host, out if out.any() else None


class InPlaceEvict(_InPlace):
    """Put the pages straight from the KV rows. On the CPU the put runs on the caller's
    thread (``evict`` returns once the store has read the rows); on CUDA, or with
    ``background``, on a put worker, ``transfer.gathered`` completing when it ends."""

    def __init__(self, *, background: bool, **shared):
        super().__init__(**shared)
        self._background = background

    def run(self, request: Request, transfer: Transfer) -> Transfer:
        if not self._background:
            with self._life.inline_run() as allowed:
                if not allowed:
                    raise KVMoveError("the KVMover is closed")
                transfer.add_piece(0, self._put(request))
            return transfer
        future = self._life.submit(self._put, request, True, put=True)
        transfer.add_piece(0, future)
        transfer.gathered = FutureEvent(future)
        return transfer

    def _put(self, request: Request, background: bool = False) -> TransferResult:
        """The put, on the caller's thread or, ``background``, on a put worker: there it
        returns only once Mooncake has, a put that timed out included (the engine holds
        the rows until it ends and would wait anyway; what it stored is removed then). On
        a caller's thread it keeps the store's bound."""
        n = len(request.keys)
        statuses, codes = [Status.FAILED] * n, [BAD_ROWS] * n
        pages, bad = self._host_pages(request)
        if bad is None:  # the usual case: every key, as called (no per-key selection)
            good = None  # the positions of the keys described: all of them
            desc = self.rows.describe_trusted(
                pages, self.keyspace.store_keys(request.keys), request.valid, get=False)
        else:
            good = stored_keys(bad, n)
            desc = self.rows.describe_trusted(
                pages[good],
                self.keyspace.store_keys([request.keys[i] for i in good.tolist()]),
                request.valid[good], get=False)
        held = self._life.held_keys
        if held:  # a put of these keys that timed out earlier may still store them
            taken = np.fromiter((k in held for k in desc.keys), dtype=bool, count=len(desc))
            if taken.any():
                log.warning("evict: %d keys not stored: an earlier in-place put of them "
                            "timed out and is still in flight", int(taken.sum()))
                if good is None:
                    good = np.arange(n)
                for i in good[taken].tolist():
                    codes[i] = CALL_TIMEOUT
                good = good[~taken]
                desc = desc.select(np.flatnonzero(~taken).tolist())
        t0 = time.perf_counter()
        options = request.put_options
        if background:
            options.update(_UNTIL_RETURNED)
        got, got_codes, _, late_stored = store_call(self.store.put, desc, **options)
        times = StageTimes(put=time.perf_counter() - t0)
        if len(got) == n:  # every key was put
            statuses, codes = got, got_codes
        else:  # some were not (good is set: bad rows, or keys held)
            for i, st, code in zip(good.tolist(), got, got_codes, strict=True):
                statuses[i], codes[i] = st, code
        if late_stored is not None:
            self._life.hold_keys(late_stored, [k for k, c in zip(desc.keys, got_codes,
                                                                 strict=True)
                                               if c == CALL_TIMEOUT])
        result = TransferResult(statuses, codes, ok_bytes(desc, got), times)
        self._life.count(result, put=True)
        return result


class InPlacePrefetch(_InPlace):
    """Get the objects straight into the KV rows, on a worker or a waiting caller: every
    layer lands with the get (a layer-wise prefetch reports them all at once)."""

    def run(self, request: Request, transfer: Transfer) -> Transfer:
        job = StealableJob(partial(self._get, request, transfer.progress),
                           self._life.inline_run, for_layer_waiters=True)
        self._life.start(job)
        transfer.add_piece(0, job)
        return transfer

    def _get(self, request: Request, progress: LayerProgress) -> TransferResult:
        """Keys with out-of-range rows read into the discard row, so that their status is
        the store's, as when staged, then end FAILED (``BAD_ROWS``) if they were OK."""
        try:
            pages, bad = self._host_pages(request)
            desc = self.rows.describe_trusted(pages, self.keyspace.store_keys(request.keys),
                                              request.valid, get=True, bad=bad)
            t0 = time.perf_counter()
            # The rows go back to the engine only once a get that timed out has returned,
            # so the get runs on this job's thread, watched, with no hand-off: a worker's,
            # or a caller's that ran the job in its unbounded wait (it waits for the whole
            # get either way; a hand-off there measured ~25 us slower per 1-page call).
            statuses, codes, in_flight, _ = store_call(self.store.get, desc,
                                                       **_UNTIL_RETURNED)
            if in_flight is not None:
                # A get that timed out may still write into the KV rows until Mooncake
                # returns (at most its own transfer timeout, 60 s): the prefetch ends only
                # then, so that no byte lands in rows the engine took back.
                log.warning("in-place prefetch: a store call timed out; waiting for it to "
                            "return before the rows go back to the engine")
                wait_until_returned(in_flight)
            times = StageTimes(get=time.perf_counter() - t0)
            if bad is not None:
                ok = np.fromiter((s is Status.OK for s in statuses), dtype=bool,
                                 count=len(statuses))
                fail_bad(bad & ok, statuses, codes)
            result = TransferResult(statuses, codes, ok_bytes(desc, statuses), times)
            self._life.count(result, put=False)
            progress.all_done(None)
            return result
        finally:
            progress.finish()
