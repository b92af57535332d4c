"""The staged path: an evict gathers into staging and puts from it; a prefetch gets into
staging, verifies checksums and scatters what is OK. Calls larger than the staging run in
staging-sized pieces. The contract is ``docs/API.md``, "KVMover"."""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial

import numpy as np
import torch

from kvmove.errors import StagingFull
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import StagingBuffer
from kvmove.mover.lifecycle import Lifecycle
from kvmove.mover.outcomes import (
    fail_bad,
    not_started,
    ok_bytes,
    store_call,
    stored_keys,
    unstaged,
)
from kvmove.mover.request import Request
from kvmove.mover.transfer import (
    LayerProgress,
    StageTimes,
    StealableJob,
    Transfer,
    TransferResult,
    join_results,
)
from kvmove.objects.checksum import PageChecksum
from kvmove.objects.descriptors import Descriptors, describe_trusted
from kvmove.objects.keys import KeySpace, RawKeys
from kvmove.rows.copy_engine.device_ring import prepare_rings
from kvmove.rows.host_indices import to_device
from kvmove.rows.moves import copy_pages, plan_pages, run_pages
from kvmove.rows.prepared import prepared_copy
from kvmove.status import BAD_ROWS, CHECKSUM_MISMATCH, Status
from kvmove.store.protocol import Store

log = logging.getLogger(__name__)


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """The groups a layer-wise scatter copies one at a time, as ``(first, end)`` layer
    ranges: layer 0 alone, then groups that double (1, 2-3, 4-7, ...) up to the last layer:
    layer ``l`` lands no later than layer ``2l`` would, with one copy per group (7 for 61
    layers) instead of one per layer."""
    groups, first = [], 0
    while first < num_layers:
        end = min(num_layers, first + max(1, first))
        groups.append((first, end))
        first = end
    return groups


class Copies:
    """The copies between a cache and its staging, prepared when the mover is built: the
    gather, the scatter of every layer, and the scatter of each group of layers
    (:func:`layer_groups`); on CUDA the two-hop rings and a warm-up launch of each."""

    def __init__(self, kv: KVCache, staging: StagingBuffer, *, backend: str, page_tokens: int,
                 evict_stream):
        pools = kv.row_pool, staging.row_pool
        common = {"backend": backend, "page_tokens": page_tokens}
        self.gather = prepared_copy(*pools, direction="gather", **common)
        self.scatter_all = prepared_copy(*pools[::-1], direction="scatter", **common)
        # A layer-wise scatter, group by group: (its copy, the layer after the group)
        self.scatter_groups = [
            (prepared_copy(*pools[::-1], list(range(first, end)), direction="scatter",
                           **common), end)
            for first, end in layer_groups(kv.max_layers)]
        self.rings = None
        if evict_stream is not None:  # on CUDA
            if any("two_hop" in p.backends for p in (self.gather, self.scatter_all)):
                self.rings = prepare_rings(kv.row_pool, staging.num_rows)
            self._warm_up(evict_stream)

    def _warm_up(self, stream) -> None:
        """Compile (or load) every kernel, before serving: launches of each prepared copy
        that skip their only row, on the evict stream (the skip rows made there too: made
        on the caller's stream they could be read before they are written)."""
        with torch.cuda.stream(stream):
            for prepared in (self.gather, self.scatter_all,
                             *(copy for copy, _ in self.scatter_groups)):
                prepared.warm_up()
        stream.synchronize()


class _Staged:
    """What both staged directions share."""

    def __init__(self, *, staging: StagingBuffer, copies: Copies, keyspace: KeySpace | RawKeys,
                 store: Store, life: Lifecycle, checksum: PageChecksum | None, stream,
                 alloc_timeout: float | None):
        self.staging, self.copies, self.keyspace = staging, copies, keyspace
        self.store, self._life, self._checksum = store, life, checksum
        self._stream = stream  # CUDA: the direction's stream; None on the CPU
        self._alloc_timeout = alloc_timeout
        self._page_tokens = staging.page_tokens
        self._page_rows = np.arange(self._page_tokens)  # a page's row numbers, for masks

    def _describe(self, slots: torch.Tensor, store_keys: list[str], valid: np.ndarray
                  ) -> Descriptors:
        """The objects' descriptors (``store_keys``: the keys as stored); with checksums,
        each ends with its slot's trailer."""
        desc = describe_trusted(self.staging, slots.numpy(), store_keys, valid)
        if self._checksum is None or len(desc) == 0:
            return desc
        trailer = self.staging.trailer
        return desc._with_trailer((slots * trailer.shape[1] + trailer.data_ptr()).tolist(),
                                  trailer.shape[1])  # the staging's own trailer rows


class StagedEvict(_Staged):
    """Gather each piece into staging on the caller's thread (CUDA: enqueue it), put it on
    a put worker."""

    def run(self, request: Request, transfer: Transfer) -> Transfer:
        size = self.staging.num_slots
        timeout = self._alloc_timeout if request.wait_for_staging else 0
        n = len(request.keys)
        for first in range(0, n, size):
            piece = request.piece(first, min(n, first + size))
            # A later piece that cannot start fails its keys instead of raising: the pieces
            # before it are in flight, and their statuses must reach the caller.
            try:
                slots = self.staging.alloc(len(piece.keys), timeout=timeout)
            except StagingFull:
                if first == 0:
                    raise
                transfer.add_piece(first, unstaged(n - first, timeout))
                break
            except Exception as e:
                if first == 0:
                    raise
                transfer.add_piece(first, not_started(n - first, e, closed=self._life.closed))
                break
            gathered = None
            try:
                t0 = time.perf_counter()
                gathered = self._run_gather(piece, slots, request.ordered)  # every piece waits
                gather_s = time.perf_counter() - t0
                future = self._life.submit(self._put_job, piece, slots, gathered, gather_s,
                                           put=True)
            except BaseException as e:
                if gathered is not None:  # a CUDA gather may still be writing into the slots
                    gathered.synchronize()
                self.staging.free(slots)
                if first == 0 or not isinstance(e, Exception):
                    raise
                transfer.add_piece(first, not_started(n - first, e, closed=self._life.closed))
                break
            transfer.add_piece(first, future)
            if gathered is not None:
                transfer.gathered = gathered
        return transfer

    def _run_gather(self, piece: Request, slots: torch.Tensor, ordered):
        """Enqueue (CUDA) or run (CPU) the gather of a piece; on CUDA the event after it."""
        stream = self._stream
        if stream is None:
            copy_pages(self.copies.gather, piece.index_tensor(), slots, None)
            return None
        with torch.cuda.stream(stream):
            if ordered is not None:
                stream.wait_event(ordered)
            copy_pages(self.copies.gather, piece.index_tensor(), slots, None)
            # the put job finds the padding and the keys with a row out of range (the
            # kernel skipped those rows) on the host: one copy back, no check kernels
            piece.fetch_pages()
            event = torch.cuda.Event(blocking=True)  # a worker sleeps on it, never spins
            event.record(stream)
        return event

    @contextlib.contextmanager
    def _begin_put(self, store_keys: list[str], options: dict):
        """A put of ``store_keys`` whose exists check starts now, while the gather ends and
        the descriptors are made (``Store.begin_put``): yields the put to call with them.
        A store that cannot begin (closed, say) yields its plain ``put``, whose failure
        then ends the keys' statuses as any put's does."""
        store = self.store
        try:
            pending = store.begin_put(store_keys, **options)
        except Exception as e:
            log.debug("begin_put of %d keys: %s; a plain put follows", len(store_keys), e)
            pending = None
        if pending is None:
            yield partial(store.put, **options) if options else store.put
            return
        with pending:
            yield pending.put

    def _put_job(self, piece: Request, slots: torch.Tensor, gathered, gather_s: float
                 ) -> TransferResult:
        times = StageTimes(gather=gather_s)
        n = len(piece.keys)
        statuses, codes = [Status.FAILED] * n, [BAD_ROWS] * n
        in_flight = None
        try:
            store_keys = self.keyspace.store_keys(piece.keys)
            # the master answers which keys exist while the gather ends and the put is made
            with self._begin_put(store_keys, piece.put_options) as put:
                if gathered is not None:
                    gathered.synchronize()
                bad = piece.bad_on_host()
                good = stored_keys(bad, n)
                self._zero_padding(piece, slots)
                kept = slots if bad is None else slots[torch.from_numpy(good)]
                valid = piece.valid[good]
                if self._checksum is not None:
                    t0 = time.perf_counter()
                    self._checksum.write(kept, torch.from_numpy(valid))
                    times.gather += time.perf_counter() - t0
                if bad is not None:
                    store_keys = [store_keys[i] for i in good.tolist()]
                desc = self._describe(kept, store_keys, valid)
                t0 = time.perf_counter()
                got, got_codes, in_flight, _ = store_call(put, desc)
                times.put = time.perf_counter() - t0
            for i, st, code in zip(good.tolist(), got, got_codes, strict=True):
                statuses[i], codes[i] = st, code
        finally:
            self._life.free_after(slots, in_flight)
        result = TransferResult(statuses, codes, ok_bytes(desc, got), times)
        self._life.count(result, put=True)
        return result

    def _zero_padding(self, piece: Request, slots: torch.Tensor) -> None:
        """Zero the staging rows of the ``-1`` entries within a page's valid tokens: the
        gather skips them, and an object holds zeros there whichever the path, never what
        the slot held before (another key's rows). One compare when there is none."""
        pages = piece.pages_on_host()
        pad = pages < 0
        if not pad.any():
            return
        pad &= self._page_rows[None, :] < piece.valid[:, None]
        key, token = np.nonzero(pad)
        if key.size == 0:
            return
        slot, token = slots[torch.from_numpy(key)], torch.from_numpy(token)
        staging = self.staging
        for name in staging.buffer_names:
            tensor = staging.tensor(name)
            if staging.layout == "page_first":  # [slots, page_tokens, L, row bytes]
                tensor[slot, token] = 0
            else:  # [L, slots, page_tokens * row bytes]
                tensor.view(tensor.shape[0], staging.num_slots, staging.page_tokens,
                            -1)[:, slot, token] = 0


class StagedPrefetch(_Staged):
    """Get each piece into staging on a worker (or a waiting caller, see ``run``), verify,
    scatter the OK keys' pages: all layers, or group of layers by group."""

    def run(self, request: Request, transfer: Transfer) -> Transfer:
        # A caller that waits before a worker has picked the job up runs it itself, with no
        # thread hand-off on its way (a worker woken after a rest copied 1.7x slower than
        # the waiting caller on a 2-core machine). Layer by layer only a whole wait() runs
        # it: a wait_layer() caller wants its first layer while the next are scattered.
        job = StealableJob(partial(self._get_job, request, request.layerwise,
                                   transfer.progress),
                           self._life.inline_run, for_layer_waiters=not request.layerwise)
        self._life.start(job)
        transfer.add_piece(0, job)
        return transfer

    def _get_job(self, request: Request, layerwise: bool, progress: LayerProgress
                 ) -> TransferResult:
        results, event = [], None
        try:
            n, size = len(request.keys), self.staging.num_slots
            for first in range(0, n, size):
                last = min(n, first + size)
                try:
                    slots = self.staging.alloc(last - first, timeout=self._alloc_timeout)
                except StagingFull:
                    results.append(unstaged(n - first, self._alloc_timeout))
                    break
                in_flight = []
                try:
                    result, event = self._get_piece(
                        request.piece(first, last), slots, layerwise and last == n, progress,
                        request.ordered, in_flight)  # every piece: the first may scatter none
                finally:
                    self._life.free_after(slots, in_flight[0] if in_flight else None)
                results.append(result)
            progress.all_done(event)
        finally:
            progress.finish()
        return join_results(results) if results else TransferResult([], [], 0)

    def _get_piece(self, piece: Request, slots: torch.Tensor, layerwise: bool,
                   progress: LayerProgress, ordered, in_flight: list
                   ) -> tuple[TransferResult, object]:
        times = StageTimes()
        t0 = time.perf_counter()
        desc = self._describe(slots, self.keyspace.store_keys(piece.keys), piece.valid)
        statuses, codes, timed_out, _ = store_call(self.store.get, desc)
        in_flight.append(timed_out)  # a get that timed out may still write into these slots
        if self._checksum is not None:
            self._verify(slots, piece.valid, statuses, codes)
        times.get = time.perf_counter() - t0
        ok = np.fromiter((s is Status.OK for s in statuses), dtype=bool, count=len(statuses))
        if isinstance(piece.bad, np.ndarray):  # host indices, check=False
            fail_bad(piece.bad & ok, statuses, codes)
            ok &= ~piece.bad
        t0 = time.perf_counter()
        event = self._scatter(piece, slots, ok, layerwise, progress, ordered)
        times.scatter = time.perf_counter() - t0
        if isinstance(piece.bad, torch.Tensor) and ok.any():
            # Device indices: fetched with the scatter (there was one: some key was OK), known
            # on the host now that it has finished.
            fail_bad(piece.bad_on_host() & ok, statuses, codes)
        result = TransferResult(statuses, codes, ok_bytes(desc, statuses), times)
        self._life.count(result, put=False)
        return result, event

    def _scatter(self, piece: Request, slots: torch.Tensor, ok: np.ndarray, layerwise: bool,
                 progress: LayerProgress, ordered):
        """Scatter the pages of the keys in ``ok`` (on a device, without an out-of-range
        row), each page's first ``valid`` rows: all layers, or group by group reporting each
        to ``progress``. Returns once copied (CUDA: finished on the prefetch stream, the
        slots are freed after it) the CUDA event after it, or None."""
        stream = self._stream
        if not ok.any():
            return None
        copies = self.copies
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if ordered is not None:
                stream.wait_event(ordered)
            piece.check_on_device()  # device pages: on this stream, after the caller's event
            pages = piece.index_tensor()
            device_bad = isinstance(piece.bad, torch.Tensor)
            keep = None if ok.all() else ok[:, None]  # [n, 1] or [n, page_tokens]
            short = piece.valid < self._page_tokens
            if short.any():
                rows = self._page_rows[None, :] < piece.valid[:, None]
                keep = rows if keep is None else keep & rows
            mask = None  # the rows not kept become -1 (skipped)
            if keep is not None:
                mask = torch.from_numpy(keep)
                if pages.is_cuda:
                    mask = to_device(mask, pages.device)  # no wait for the stream
            if device_bad:  # made on the device: no host copy
                piece.fetch_bad()
                good = ~piece.bad[:, None]
                mask = good if mask is None else mask & good
            if mask is not None:
                pages = torch.where(mask, pages, -1)
            event = None
            plan = plan_pages(copies.scatter_all, pages, slots)  # one plan for every layer
            for prepared, end in (copies.scatter_groups if layerwise
                                  else ((copies.scatter_all, None),)):
                run_pages(prepared, plan, None)
                if stream is not None:
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                if layerwise:
                    progress.layers_done(end, event)
        if event is not None:
            event.synchronize()  # the slots are freed once this returns (a sleep, no spin)
        return event

    def _verify(self, slots: torch.Tensor, valid: np.ndarray, statuses: list[Status],
                codes: list[int]) -> None:
        """Mark FAILED (``CHECKSUM_MISMATCH``) every OK key whose bytes do not match."""
        got = [i for i, s in enumerate(statuses) if s is Status.OK]
        if not got:
            return
        idx = torch.tensor(got, dtype=torch.int64)
        valid = torch.from_numpy(valid[got])  # a copy: the call's array may be read-only
        for i, good in zip(got, self._checksum.matches(slots[idx], valid).tolist(), strict=True):
            if not good:
                statuses[i], codes[i] = Status.FAILED, CHECKSUM_MISMATCH
                log.warning("object %s failed its checksum; not scattered", i)
