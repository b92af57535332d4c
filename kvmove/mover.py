"""``KVMover``: the HiSparse evict (gather + put) and prefetch (get + scatter) paths."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvmove.cache import KVCache
from kvmove.checksum import TRAILER_BYTES, PageChecksum
from kvmove.copy import gather, kernel_device, resolve_backend, scatter
from kvmove.describe import Descriptors, check_keys, describe
from kvmove.errors import KVMoveError, StagingFull
from kvmove.indices import as_index_tensor, check_range, check_unique
from kvmove.keys import KeySpace
from kvmove.staging import StagingBuffer
from kvmove.status import CHECKSUM_MISMATCH, Status
from kvmove.transfer import StageTimes, Transfer, TransferResult

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
    registered with ``store`` once. ``evict`` gathers into staging and puts in the
    background; ``prefetch`` gets into staging in the background and scatters the keys
    whose status is OK. Staging slots return to the pool when a transfer ends, whatever its
    outcome. When the staging is full, a call waits up to ``alloc_timeout`` seconds for
    slots, then raises :class:`StagingFull`; pages are never dropped.

    ``layout`` is the staging's and so the objects' layout: ``"layer_first"`` (one span
    per layer) or ``"page_first"`` (one span per buffer, token by token; SGLang's
    ``page_first`` object). Keys are namespaced by a fingerprint of the cache geometry, the
    layout and ``key_prefix``: a mover never reads an object of the other layout.

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
        layout: str = "layer_first",
    ):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.kv = kv
        self.store = store
        self.staging = StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens,
                                     trailer_bytes=TRAILER_BYTES if checksum else 0,
                                     layout=layout)
        self._checksum = PageChecksum(self.staging) if checksum else None
        self.page_tokens = page_tokens
        self.device = kernel_device(kv.row_pool, self.staging.row_pool)
        resolve_backend(backend, self.device)  # validates; "auto" is resolved per copy
        self.backend = backend
        self.keyspace = KeySpace(kv, page_tokens, key_prefix, checksum=checksum,
                                 layout=layout)
        self.alloc_timeout = alloc_timeout
        self.check = check
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvmove")
        self._lock = threading.Lock()
        self._inflight: set[Future] = set()
        self._stats = MoverStats(statuses={s: 0 for s in Status})
        self._closed = False
        store.register(self.staging)

    # -- public ---------------------------------------------------------------------------
    def evict(self, keys, token_pages, *, valid_tokens=None) -> Transfer:
        """Gather the pages ``token_pages`` ``[n, page_tokens]`` (``-1`` = padding) into
        staging and put them under ``keys`` in the background. ``valid_tokens`` (an int or
        one per key) stores a partial last page. Returns once the gather is enqueued (CUDA)
        or done (CPU); ``Transfer.gathered`` tells when the KV rows may be overwritten."""
        keys, token_pages = self._check_call(keys, token_pages)
        slots = self._alloc(len(keys))
        gathered = None
        try:
            desc = self._describe(slots, keys, valid_tokens)
            t0 = time.perf_counter()
            gathered = self._gather(token_pages, slots)
            gather_s = time.perf_counter() - t0
            future = self._submit(self._put_job, desc, slots, gathered, gather_s,
                                  valid_tokens)
        except BaseException:
            if gathered is not None:  # a CUDA gather may still be writing into the slots
                gathered.synchronize()
            self.staging.free(slots)
            raise
        return Transfer(keys, future, kind="evict", num_layers=self.kv.max_layers,
                        gathered=gathered)

    def prefetch(self, keys, token_pages, *, layerwise: bool = False,
                 valid_tokens=None) -> Transfer:
        """Get ``keys`` into staging in the background and scatter the pages whose status is
        OK into ``token_pages`` ``[n, page_tokens]`` (``-1`` = leave that KV row alone). With
        ``layerwise=True`` the scatter runs layer by layer and ``Transfer.wait_layer(l)``
        returns as soon as layer ``l`` is in place. Rows of missing or failed keys are left
        untouched. ``valid_tokens`` must match what the pages were evicted with."""
        keys, token_pages = self._check_call(keys, token_pages)
        if self.check:
            check_range(token_pages, self.kv.num_slots, "token_pages")
            check_unique(token_pages, "token_pages")
        slots = self._alloc(len(keys))
        transfer_box: list[Transfer] = []
        ready = threading.Event()
        try:
            desc = self._describe(slots, keys, valid_tokens)
            future = self._submit(self._get_job, desc, slots, token_pages, layerwise,
                                  valid_tokens, transfer_box, ready)
        except BaseException:
            self.staging.free(slots)
            raise
        transfer = Transfer(keys, future, kind="prefetch", num_layers=self.kv.max_layers)
        transfer_box.append(transfer)
        ready.set()
        return transfer

    def stats(self) -> MoverStats:
        with self._lock:
            s = self._stats
            return MoverStats(**{**s.__dict__, "statuses": dict(s.statuses)})

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

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
        self.staging.close()

    def __enter__(self) -> KVMover:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps ----------------------------------------------------------------------------
    def _check_call(self, keys, token_pages):
        if self._closed:
            raise KVMoveError("the KVMover is closed")
        keys = check_keys(keys)
        token_pages = as_index_tensor(token_pages, "token_pages", dim=2, device=self.device)
        if token_pages.shape[0] != len(keys):
            raise ValueError(
                f"token_pages has {token_pages.shape[0]} pages for {len(keys)} keys"
            )
        if len(keys) and token_pages.shape[1] != self.page_tokens:
            raise ValueError(
                f"token_pages has {token_pages.shape[1]} tokens per page, the mover's "
                f"page_tokens is {self.page_tokens}"
            )
        if len(keys) > self.staging.num_slots:
            raise StagingFull(
                f"{len(keys)} keys in one call exceed the staging's {self.staging.num_slots} "
                f"slots: split the batch or raise staging_slots"
            )
        return keys, token_pages

    def _alloc(self, n: int) -> torch.Tensor:
        return self.staging.alloc(n, timeout=self.alloc_timeout)

    def _describe(self, slots: torch.Tensor, keys: list[str], valid_tokens) -> Descriptors:
        """The objects' descriptors; with checksums, each ends with its slot's trailer."""
        desc = describe(self.staging, slots, self.keyspace.store_keys(keys),
                        valid_tokens=valid_tokens)
        if self._checksum is None or len(desc) == 0:
            return desc
        trailer = self.staging.trailer
        return desc.with_trailer((slots * trailer.shape[1] + trailer.data_ptr()).tolist(),
                                 trailer.shape[1])

    def _valid_tokens(self, valid_tokens, n: int) -> torch.Tensor:
        """``valid_tokens`` (already validated by ``describe``) as int64 ``[n]``."""
        if valid_tokens is None:
            return torch.full((n,), self.page_tokens, dtype=torch.int64)
        return torch.as_tensor(valid_tokens, dtype=torch.int64).reshape(-1).expand(n)

    def _gather(self, token_pages: torch.Tensor, slots: torch.Tensor):
        if self._stream is None:
            gather(self.kv, self.staging, token_pages, slots, backend=self.backend,
                   check=self.check)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            gather(self.kv, self.staging, token_pages, slots, backend=self.backend,
                   check=self.check)
            event = torch.cuda.Event()
            event.record(self._stream)
        if token_pages.is_cuda:
            token_pages.record_stream(self._stream)
        return event

    def _submit(self, fn, *args) -> Future:
        """Queue a background job, unless the mover was closed meanwhile (then the caller
        frees its slots and the call raises ``KVMoveError``)."""
        with self._lock:
            if self._closed:
                raise KVMoveError("the KVMover is closed")
            future = self._executor.submit(fn, *args)
            self._inflight.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._inflight.discard(future)

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
    def _put_job(self, desc: Descriptors, slots, gathered, gather_s, valid_tokens):
        times = StageTimes(gather=gather_s)
        try:
            if gathered is not None:
                gathered.synchronize()
            if self._checksum is not None:
                t0 = time.perf_counter()
                self._checksum.write(slots, self._valid_tokens(valid_tokens, len(slots)))
                times.gather += time.perf_counter() - t0
            t0 = time.perf_counter()
            statuses, codes = self._store_call(self.store.put, desc)
            times.put = time.perf_counter() - t0
        finally:
            self.staging.free(slots)
        nbytes = sum(desc.nbytes(i) for i, s in enumerate(statuses) if s is Status.OK)
        result = TransferResult(statuses, codes, nbytes, times)
        self._count(result, put=True)
        return result

    def _get_job(self, desc: Descriptors, slots, token_pages, layerwise, valid_tokens, box,
                 ready):
        ready.wait()
        transfer: Transfer = box[0]
        times = StageTimes()
        try:
            t0 = time.perf_counter()
            statuses, codes = self._store_call(self.store.get, desc)
            if self._checksum is not None:
                self._verify(slots, valid_tokens, statuses, codes)
            times.get = time.perf_counter() - t0
            ok = torch.tensor([s is Status.OK for s in statuses], dtype=torch.bool)  # host
            t0 = time.perf_counter()
            if bool(ok.any()):
                if bool(ok.all()):  # the usual case: the index tensors as they are, no copies
                    found_slots, found_pages = slots, token_pages
                else:
                    found_slots, found_pages = slots[ok], token_pages[ok.to(token_pages.device)]
                self._scatter(found_slots, found_pages, transfer, layerwise)
            times.scatter = time.perf_counter() - t0
        finally:
            transfer._all_layers_done()
            self.staging.free(slots)
        nbytes = sum(desc.nbytes(i) for i, s in enumerate(statuses) if s is Status.OK)
        result = TransferResult(statuses, codes, nbytes, times)
        self._count(result, put=False)
        return result

    def _verify(self, slots, valid_tokens, statuses: list[Status], codes: list[int]) -> None:
        """Mark FAILED (code -801) every OK key whose bytes do not match its checksum."""
        got = [i for i, s in enumerate(statuses) if s is Status.OK]
        if not got:
            return
        idx = torch.tensor(got, dtype=torch.int64)
        valid = self._valid_tokens(valid_tokens, len(slots))[idx]
        for i, good in zip(got, self._checksum.matches(slots[idx], valid).tolist(), strict=True):
            if not good:
                statuses[i], codes[i] = Status.FAILED, CHECKSUM_MISMATCH
                log.warning("object %s failed its checksum; not scattered", i)

    def _scatter(self, slots, token_pages, transfer: Transfer, layerwise: bool) -> None:
        layer_sets = range(self.kv.max_layers) if layerwise else [None]
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else None
        if stream_ctx is not None:
            stream_ctx.__enter__()
        try:
            for layer in layer_sets:
                scatter(self.staging, slots, self.kv, token_pages, layers=layer,
                        backend=self.backend, check=False)
                event = None
                if self._stream is not None:
                    event = torch.cuda.Event()
                    event.record(self._stream)
                if layer is not None:
                    transfer._layer_done(layer, event)
            if self._stream is not None:
                self._stream.synchronize()  # staging slots are freed after this returns
        finally:
            if stream_ctx is not None:
                stream_ctx.__exit__(None, None, None)

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
