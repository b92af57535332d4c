"""``KVMover``: the HiSparse evict (gather + put) and prefetch (get + scatter) paths."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvmove.checks import (
    as_index_tensor,
    check_keys,
    check_positive_int,
    check_range,
    check_unique,
    check_valid_tokens,
    small_rows_ok,
)
from kvmove.checksum import TRAILER_BYTES, PageChecksum
from kvmove.descriptors import Descriptors, describe_trusted
from kvmove.errors import KVMoveError, StagingFull
from kvmove.keys import KeySpace, RawKeys
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import StagingBuffer
from kvmove.rows.device_ring import prepare_rings
from kvmove.rows.moves import copy_pages, plan_pages, run_pages
from kvmove.rows.prepared import kernel_device, prepared_copy, resolve_backend
from kvmove.status import BAD_ROWS, CHECKSUM_MISMATCH, STAGING_TIMEOUT, Status
from kvmove.transfer import LayerProgress, StageTimes, Transfer, TransferResult, join_results
from kvmove.tuning.autotune import tune_for_copies

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


class KVMover:
    """Evict KV pages to a Mooncake store and prefetch them back.

    The mover owns a layer-first :class:`StagingBuffer` of ``staging_slots`` pages,
    registered with ``store`` once, and the prepared copies between it and the cache (on
    CUDA: kernels compiled, tuned configs read, rings allocated, all when it is built).
    ``evict`` gathers into staging and puts in the background; ``prefetch`` gets into
    staging in the background and scatters the keys whose status is OK. Staging slots return
    to the pool when a transfer ends, whatever its outcome.

    A call may name more keys than the staging has slots: it runs in staging-sized pieces
    under back-pressure (an evict returns once its last piece is gathered) and its
    :class:`Transfer` gives one status per key, in order. Where no slots come free within
    ``alloc_timeout`` seconds, the first piece of an evict raises :class:`StagingFull`
    (nothing was started); keys of a later piece, or of a prefetch, end ``FAILED`` (raw code
    ``STAGING_TIMEOUT``) with their KV rows as they were. Pages are never dropped silently.

    Indices are validated once, at the call. CPU index tensors are copied at call time (the
    engine may reuse its buffer at once); with ``check=True`` an out-of-range row or a
    repeated destination raises before anything is written, with ``check=False`` the key
    with such a row ends ``FAILED`` (raw code ``BAD_ROWS``). Device index tensors are never
    read on the host: they are copied on the caller's stream and out-of-range rows make
    their key ``FAILED`` (``BAD_ROWS``) when the transfer is waited on; such a key is never
    stored, and its rows are never scattered.

    On CUDA every copy runs on the mover's streams (one for evictions, one at high priority
    for prefetches), ordered after the work the caller's current stream had enqueued at
    call time; ``Transfer.gathered`` / ``Transfer.scattered`` / ``Transfer.wait_layer`` order
    the engine after them.

    ``layout`` is the staging's and so the objects' layout: ``"layer_first"`` (one span
    per layer) or ``"page_first"`` (one span per buffer, token by token; SGLang's
    ``page_first`` object). Keys are namespaced by a fingerprint of the cache geometry, the
    layout and ``key_prefix``: a mover never reads an object of the other layout. With
    ``raw_keys=True`` they are used exactly as given (keys that another system defines,
    such as vLLM's connector keys, which encode the model, ranks and block hash).

    With ``checksum=True`` every object carries an 8-byte fingerprint of its bytes, computed
    from the staging after the gather and verified after the get: a page whose bytes do not
    match is reported ``FAILED`` (raw code -801) and never scattered. Off by default (it
    costs a host pass over the staged bytes; ``bench`` reports the overhead).
    """

    def __init__(
        self,
        kv: KVCache,
        store,
        *,
        page_tokens: int = 64,
        staging_slots: int = 1024,
        backend: str = "auto",
        key_prefix: str = "",
        workers: int = 2,
        alloc_timeout: float | None = 60.0,
        check: bool = True,
        checksum: bool = False,
        raw_keys: bool = False,
        layout: str = "layer_first",
    ):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        check_positive_int(workers, "workers")
        self.kv = kv
        self.store = store
        self.staging = StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens,
                                     trailer_bytes=TRAILER_BYTES if checksum else 0,
                                     layout=layout)
        self._checksum = PageChecksum(self.staging) if checksum else None
        self.page_tokens = page_tokens
        self.device = kernel_device(kv.row_pool, self.staging.row_pool)
        resolve_backend(backend, self.device)  # validates; "auto" is resolved per buffer
        self.backend = backend
        if raw_keys and key_prefix:
            raise ValueError(f"key_prefix must be empty with raw_keys=True, got {key_prefix!r}")
        self.keyspace = (RawKeys() if raw_keys
                         else KeySpace(kv, page_tokens, key_prefix, checksum=checksum,
                                       layout=layout))
        self.alloc_timeout = alloc_timeout
        self.check = check
        cuda = self.device.type == "cuda"
        # KVMOVE_AUTOTUNE=1 tunes here, before the copies are prepared (they read the tuned
        # configs), never inside a call (nothing to tune off CUDA).
        tune_for_copies(self.device, [kv.row_bytes(n) for n in kv.buffer_names], page_tokens)
        pools = kv.row_pool, self.staging.row_pool
        common = {"backend": backend, "page_tokens": page_tokens}
        self._gather = prepared_copy(*pools, direction="gather", **common)
        self._scatter_all = prepared_copy(*pools[::-1], direction="scatter", **common)
        self._scatter_layer = [prepared_copy(*pools[::-1], layer, direction="scatter",
                                             **common) for layer in range(kv.max_layers)]
        self._evict_stream = torch.cuda.Stream(self.device) if cuda else None
        self._prefetch_stream = (torch.cuda.Stream(self.device, priority=-100) if cuda
                                 else None)
        if cuda:
            if any("two_hop" in p.backends for p in (self._gather, self._scatter_all)):
                self._rings = prepare_rings(kv.row_pool, self.staging.num_rows)
            self._warm_up()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvmove")
        self._lock = threading.Lock()
        self._stats = MoverStats(statuses={s: 0 for s in Status})
        self._closed = False
        store.register(self.staging)

    def _warm_up(self) -> None:
        """Compile (or load) every kernel the mover launches, and allocate the two-hop rings,
        before serving: one launch of each prepared copy that skips its only row."""
        skip = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        with torch.cuda.stream(self._evict_stream):
            for prepared in (self._gather, self._scatter_all, *self._scatter_layer):
                prepared.run(skip, skip, None)
        self._evict_stream.synchronize()

    # -- public ---------------------------------------------------------------------------
    def evict(self, keys, token_pages, *, valid_tokens=None) -> Transfer:
        """Gather the pages ``token_pages`` ``[n, page_tokens]`` (``-1`` = padding) into
        staging and put them under ``keys`` in the background. ``valid_tokens`` (an int or
        one per key) stores a partial last page. Returns once the gather is enqueued (CUDA)
        or done (CPU); ``Transfer.gathered`` tells when the KV rows may be overwritten."""
        call = self._take_call(keys, token_pages, valid_tokens, gathering=True)
        transfer = Transfer(call.keys, kind="evict", num_layers=self.kv.max_layers,
                            device=self.device)
        size = self.staging.num_slots
        for first in range(0, len(call.keys), size):
            piece = call.piece(first, min(len(call.keys), first + size))
            try:
                slots = self.staging.alloc(len(piece.keys), timeout=self.alloc_timeout)
            except StagingFull:
                if first == 0:
                    raise
                transfer.add_piece(first, self._unstaged(len(call.keys) - first))
                break
            gathered = None
            try:
                t0 = time.perf_counter()
                gathered = self._run_gather(piece, slots, call.ordered if first == 0 else None)
                gather_s = time.perf_counter() - t0
                future = self._submit(self._put_job, piece, slots, gathered, gather_s)
            except BaseException:
                if gathered is not None:  # a CUDA gather may still be writing into the slots
                    gathered.synchronize()
                self.staging.free(slots)
                raise
            transfer.add_piece(first, future)
            if gathered is not None:
                transfer.gathered = gathered
        return transfer

    def prefetch(self, keys, token_pages, *, layerwise: bool = False,
                 valid_tokens=None) -> Transfer:
        """Get ``keys`` into staging in the background and scatter the pages whose status is
        OK into ``token_pages`` ``[n, page_tokens]`` (``-1`` = leave that KV row alone). With
        ``layerwise=True`` the scatter runs layer by layer and ``Transfer.wait_layer(l)``
        returns as soon as layer ``l`` is in place. Rows of missing or failed keys are left
        untouched. ``valid_tokens`` must match what the pages were evicted with. Returns as
        soon as the work is scheduled."""
        call = self._take_call(keys, token_pages, valid_tokens, gathering=False)
        transfer = Transfer(call.keys, kind="prefetch", num_layers=self.kv.max_layers,
                            device=self.device)
        transfer.add_piece(0, self._submit(self._get_job, call, layerwise, transfer.progress))
        return transfer

    # -- the call -------------------------------------------------------------------------
    def _take_call(self, keys, token_pages, valid_tokens, *, gathering: bool) -> Call:
        """Validate a call's arguments (once) and take what the background work needs:
        a copy of the indices made now, and on CUDA an event after the caller's work."""
        if self._closed:
            raise KVMoveError("the KVMover is closed")
        keys = check_keys(keys)
        n = len(keys)
        pages = as_index_tensor(token_pages, "token_pages", dim=2, device=self.device)
        if pages.shape[0] != n:
            raise ValueError(f"token_pages has {pages.shape[0]} pages for {n} keys")
        if n and pages.shape[1] != self.page_tokens:
            raise ValueError(
                f"token_pages has {pages.shape[1]} tokens per page, the mover's "
                f"page_tokens is {self.page_tokens}"
            )
        valid = check_valid_tokens(valid_tokens, n, self.page_tokens)
        limit = self.kv.num_slots
        if pages.is_cuda:  # copied and checked on the caller's stream: no host reads
            pages = pages.to(torch.int64, copy=True)
            bad = ((pages < -1) | (pages >= limit)).any(dim=1) if n else None
        else:
            host = pages.numpy().astype(np.int64, copy=True)  # the engine may reuse its own
            pages = torch.from_numpy(host)
            bad = None
            if n and self.check:
                if not small_rows_ok(host, limit, unique=not gathering):
                    check_range(pages, limit, "token_pages")  # raises, naming the bad one
                    if not gathering:
                        check_unique(pages, "token_pages")
            elif n:
                out = ((host < -1) | (host >= limit)).any(axis=1)
                bad = out if out.any() else None
        ordered = None
        if self._evict_stream is not None:  # on CUDA
            caller = torch.cuda.current_stream(self.device)
            ordered = torch.cuda.Event()
            ordered.record(caller)
            if pages.is_cuda:  # made on the caller's stream, used on the mover's
                pages.record_stream(self._evict_stream if gathering else self._prefetch_stream)
                if bad is not None:
                    bad.record_stream(self._evict_stream if gathering
                                      else self._prefetch_stream)
        return Call(keys, pages, valid, bad, ordered)

    def _unstaged(self, n: int) -> TransferResult:
        log.warning("no staging slots came free within %s s: %d keys not moved",
                    self.alloc_timeout, n)
        return TransferResult([Status.FAILED] * n, [STAGING_TIMEOUT] * n, 0)

    def stats(self) -> MoverStats:
        with self._lock:
            s = self._stats
            return MoverStats(**{**s.__dict__, "statuses": dict(s.statuses)})

    def close(self) -> None:
        """Wait for in-flight transfers, then unregister and free the staging. Idempotent.

        Calls racing with ``close()`` either run to the end before it returns or raise
        :class:`KVMoveError` (their staging slots returned); the staging is unregistered only
        after every transfer has ended, so the store never refuses the unregister."""
        with self._lock:
            first, self._closed = not self._closed, True
        self._executor.shutdown(wait=True)
        if not first:
            return
        unregister = getattr(self.store, "unregister", None)
        if unregister is not None:
            try:
                unregister(self.staging)
            except Exception as e:  # the store may already be closed or its master gone
                log.warning("unregistering the staging failed: %s", e)
        # Every transfer has ended (the executor is shut down), so every slot is free: a
        # slot still allocated here is the caller's own (staging.alloc), in use or not.
        self.staging.close(timeout=5.0)

    def __enter__(self) -> KVMover:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps ----------------------------------------------------------------------------
    def _run_gather(self, piece: Call, slots: torch.Tensor, ordered):
        """Enqueue (CUDA) or run (CPU) the gather of a piece; on CUDA the event after it."""
        if self._evict_stream is None:
            copy_pages(self._gather, piece.pages, slots, None)
            return None
        with torch.cuda.stream(self._evict_stream):
            if ordered is not None:
                self._evict_stream.wait_event(ordered)
            copy_pages(self._gather, piece.pages, slots, None)
            piece.fetch_bad()
            event = torch.cuda.Event()
            event.record(self._evict_stream)
        return event

    def _describe(self, slots: torch.Tensor, keys: list[str], valid: np.ndarray) -> Descriptors:
        """The objects' descriptors; with checksums, each ends with its slot's trailer."""
        desc = describe_trusted(self.staging, slots.numpy(), self.keyspace.store_keys(keys),
                                valid)
        if self._checksum is None or len(desc) == 0:
            return desc
        trailer = self.staging.trailer
        return desc.with_trailer((slots * trailer.shape[1] + trailer.data_ptr()).tolist(),
                                 trailer.shape[1])

    def _submit(self, fn, *args) -> Future:
        """Queue a background job, unless the mover was closed meanwhile (then the caller
        frees its slots and the call raises ``KVMoveError``)."""
        with self._lock:
            if self._closed:
                raise KVMoveError("the KVMover is closed")
            return self._executor.submit(fn, *args)

    def _count(self, result: TransferResult, *, put: bool) -> None:
        with self._lock:
            s = self._stats
            ok = sum(st is Status.OK for st in result.statuses)
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
            for st in result.statuses:
                s.statuses[st] += 1

    # -- background jobs ------------------------------------------------------------------
    def _put_job(self, piece: Call, slots: torch.Tensor, gathered, gather_s: float
                 ) -> TransferResult:
        times = StageTimes(gather=gather_s)
        n = len(piece.keys)
        statuses, codes = [Status.FAILED] * n, [BAD_ROWS] * n
        try:
            if gathered is not None:
                gathered.synchronize()
            bad = piece.bad_on_host()
            good = np.arange(n) if bad is None else np.flatnonzero(~bad)
            if bad is not None:
                log.warning("evict: %d of %d keys have out-of-range rows; not stored",
                            n - good.size, n)
            kept = slots if bad is None else slots[torch.from_numpy(good)]
            valid = piece.valid[good]
            if self._checksum is not None:
                t0 = time.perf_counter()
                self._checksum.write(kept, torch.from_numpy(valid))
                times.gather += time.perf_counter() - t0
            desc = self._describe(kept, [piece.keys[i] for i in good.tolist()], valid)
            t0 = time.perf_counter()
            got, got_codes = self._store_call(self.store.put, desc)
            times.put = time.perf_counter() - t0
            for i, st, code in zip(good.tolist(), got, got_codes, strict=True):
                statuses[i], codes[i] = st, code
        finally:
            self.staging.free(slots)
        result = TransferResult(statuses, codes, _ok_bytes(desc, got), times)
        self._count(result, put=True)
        return result

    def _get_job(self, call: Call, layerwise: bool, progress: LayerProgress) -> TransferResult:
        results, event = [], None
        try:
            n, size = len(call.keys), self.staging.num_slots
            for first in range(0, n, size):
                last = min(n, first + size)
                try:
                    slots = self.staging.alloc(last - first, timeout=self.alloc_timeout)
                except StagingFull:
                    results.append(self._unstaged(n - first))
                    break
                try:
                    result, event = self._get_piece(
                        call.piece(first, last), slots, layerwise and last == n, progress,
                        call.ordered if first == 0 else None)
                finally:
                    self.staging.free(slots)
                results.append(result)
            progress.all_done(event)
        finally:
            progress.finish()
        return join_results(results) if results else TransferResult([], [], 0)

    def _get_piece(self, piece: Call, slots: torch.Tensor, layerwise: bool,
                   progress: LayerProgress, ordered) -> tuple[TransferResult, object]:
        times = StageTimes()
        t0 = time.perf_counter()
        desc = self._describe(slots, piece.keys, piece.valid)
        statuses, codes = self._store_call(self.store.get, desc)
        if self._checksum is not None:
            self._verify(slots, piece.valid, statuses, codes)
        times.get = time.perf_counter() - t0
        ok = np.fromiter((s is Status.OK for s in statuses), dtype=bool, count=len(statuses))
        if isinstance(piece.bad, np.ndarray):  # host indices, check=False
            _fail_bad(piece.bad & ok, statuses, codes)
            ok &= ~piece.bad
        t0 = time.perf_counter()
        event = self._scatter(piece, slots, ok, layerwise, progress, ordered)
        times.scatter = time.perf_counter() - t0
        if isinstance(piece.bad, torch.Tensor) and ok.any():
            # Device indices: fetched with the scatter (there was one: some key was OK), known
            # on the host now that it has finished.
            _fail_bad(piece.bad_on_host() & ok, statuses, codes)
        result = TransferResult(statuses, codes, _ok_bytes(desc, statuses), times)
        self._count(result, put=False)
        return result, event

    def _scatter(self, piece: Call, slots: torch.Tensor, ok: np.ndarray, layerwise: bool,
                 progress: LayerProgress, ordered):
        """Scatter the pages of the keys in ``ok`` (and, on a device, without an out-of-range
        row): all layers, or layer by layer reporting each to ``progress``. Returns on the
        CPU once copied, on CUDA once the copy has finished on the prefetch stream (the
        staging slots are freed after it); returns the CUDA event after it, or None."""
        stream = self._prefetch_stream
        if not ok.any():
            return None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if ordered is not None:
                stream.wait_event(ordered)
            pages = piece.pages
            device_bad = isinstance(piece.bad, torch.Tensor)
            if device_bad or not ok.all():  # the others' pages become -1 (skipped)
                mask = torch.from_numpy(ok)
                if pages.is_cuda:
                    mask = mask.to(pages.device, non_blocking=True)
                if device_bad:
                    piece.fetch_bad()
                    mask = mask & ~piece.bad
                pages = torch.where(mask[:, None], pages, -1)
            event = None
            plan = plan_pages(self._scatter_all, pages, slots)  # one plan for every layer
            for prepared in (self._scatter_layer if layerwise else (self._scatter_all,)):
                run_pages(prepared, plan, None)
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                if layerwise:
                    progress.layer_done(event)
        if stream is not None:
            stream.synchronize()  # the slots are freed once this returns
        return event

    def _verify(self, slots: torch.Tensor, valid: np.ndarray, statuses: list[Status],
                codes: list[int]) -> None:
        """Mark FAILED (code -801) every OK key whose bytes do not match its checksum."""
        got = [i for i, s in enumerate(statuses) if s is Status.OK]
        if not got:
            return
        idx = torch.tensor(got, dtype=torch.int64)
        valid = torch.from_numpy(valid)[idx]
        for i, good in zip(got, self._checksum.matches(slots[idx], valid).tolist(), strict=True):
            if not good:
                statuses[i], codes[i] = Status.FAILED, CHECKSUM_MISMATCH
                log.warning("object %s failed its checksum; not scattered", i)

    def _store_call(self, op, desc: Descriptors) -> tuple[list[Status], list[int]]:
        """Run a store put/get; an exception becomes FAILED for every key, never lost."""
        if len(desc) == 0:
            return [], []
        try:
            statuses = op(desc)
        except Exception as e:
            log.warning("%s of %d keys failed: %s", getattr(op, "__name__", "store call"),
                        len(desc), e)
            return [Status.FAILED] * len(desc), [-1] * len(desc)
        codes = list(getattr(statuses, "codes", [0 if s is Status.OK else -1 for s in statuses]))
        return list(statuses), codes


@dataclass
class Call:
    """A call's arguments, validated and taken at call time (or a piece of them)."""

    keys: list[str]
    pages: torch.Tensor  # int64 [n, page_tokens]: a copy made at call time (CPU or device)
    valid: np.ndarray  # int64 [n] valid tokens per key
    bad: np.ndarray | torch.Tensor | None  # bool [n]: a row of the key's page out of range
    ordered: object = None  # CUDA event after the caller's work at call time
    _bad_host: torch.Tensor | None = None

    def piece(self, first: int, last: int) -> Call:
        bad = None if self.bad is None else self.bad[first:last]
        return Call(self.keys[first:last], self.pages[first:last], self.valid[first:last],
                    bad, self.ordered)

    def fetch_bad(self) -> None:
        """Enqueue the copy of a device ``bad`` mask to the host (on the current stream)."""
        if isinstance(self.bad, torch.Tensor):
            self._bad_host = self.bad.to("cpu", non_blocking=True)

    def bad_on_host(self) -> np.ndarray | None:
        """``bad`` on the host: after :meth:`fetch_bad` and a wait for the stream."""
        if isinstance(self.bad, torch.Tensor):
            return self._bad_host.numpy()
        return self.bad


def _fail_bad(bad: np.ndarray, statuses: list[Status], codes: list[int]) -> None:
    for i in np.flatnonzero(bad).tolist():
        statuses[i], codes[i] = Status.FAILED, BAD_ROWS
    if bad.any():
        log.warning("prefetch: %d keys have out-of-range rows; not scattered", int(bad.sum()))


def _ok_bytes(desc: Descriptors, statuses: list[Status]) -> int:
    return sum(desc.nbytes(i) for i, s in enumerate(statuses) if s is Status.OK)
