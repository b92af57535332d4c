"""``KVMover``: the HiSparse evict (gather + put) and prefetch (get + scatter) paths."""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvmove.checks import (
    as_index_tensor,
    check_index_array,
    check_keys,
    check_layout,
    check_positive_int,
    check_range,
    check_seconds,
    check_unique,
    check_valid_tokens,
    small_rows_ok,
)
from kvmove.errors import KVMoveError, StagingFull, StoreError
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import LAYOUTS, StagingBuffer
from kvmove.mover.job_threads import JobThreads
from kvmove.mover.path_choice import PathChoice, check_path, log_choice, probe, resolve
from kvmove.mover.transfer import (
    FutureEvent,
    LayerProgress,
    StageTimes,
    StealableJob,
    Transfer,
    TransferResult,
    join_results,
)
from kvmove.objects.checksum import TRAILER_BYTES, PageChecksum
from kvmove.objects.descriptors import Descriptors, describe_trusted
from kvmove.objects.in_place import InPlaceRows
from kvmove.objects.keys import KeySpace, RawKeys
from kvmove.rows.copy_engine.device_ring import prepare_rings
from kvmove.rows.host_indices import to_device
from kvmove.rows.moves import copy_pages, plan_pages, run_pages
from kvmove.rows.prepared import kernel_device, prepared_copy, resolve_backend
from kvmove.rows.torch_backend.host_copy import start_helpers
from kvmove.status import (
    BAD_ROWS,
    CALL_TIMEOUT,
    CHECKSUM_MISMATCH,
    CLIENT_EXCEPTION,
    MOVER_CLOSED,
    STAGING_TIMEOUT,
    Status,
)
from kvmove.store.bounded_call import start_call_threads, wait_until_returned
from kvmove.tuning.autotune import tune_for_copies

log = logging.getLogger(__name__)


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """The groups a layer-wise scatter copies one at a time, as ``(first, end)`` layer
    ranges: layer 0 alone, then groups that double (1, 2-3, 4-7, ...) up to the last layer.
    The engine gets layer 0 as early as from one copy per layer, and layer ``l`` no later
    than layer ``2l`` would come, with a copy (on a GPU, a launch per buffer, whose host time
    is most of a small layer's) per group instead of per layer: 7 for 61 layers."""
    groups, first = [], 0
    while first < num_layers:
        end = min(num_layers, first + max(1, first))
        groups.append((first, end))
        first = end
    return groups


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

    ``path`` says how pages move (:mod:`kvmove.mover.path_choice`): ``"staged"`` as above;
    ``"in_place"``: the store reads and writes the KV rows where they are
    (:class:`kvmove.objects.in_place.InPlaceRows`, the KV memory registered with the store while the
    mover lives), with no staging (a one-slot staging stands in); ``"auto"`` (default): the
    faster of the two for this cache, page shape and transport, for evictions and for
    prefetches each: measured when the mover is built for one-token pages (or recorded by
    an earlier mover of the same kind); staged for pages of several tokens. ``mover.path``
    says which (``"mixed"`` where the directions differ: ``mover.path_choice.evict`` /
    ``.prefetch``, and why in ``.reason``). Objects, keys and statuses are the same on both
    paths. In place, ``evict`` returns once the put has read the rows (CPU; on CUDA, or with
    ``put_in_background=True``, it returns at once and ``gathered`` completes then: an
    engine that holds the rows until then, as vLLM holds a saved block's, keeps stepping),
    a prefetch lands every layer at once, and a ``FAILED``
    key whose transfer broke mid-way may leave part of its object in its own rows (MISS and
    SIZE_MISMATCH never write). So ``auto`` keeps prefetches staged (a failed prefetch
    leaves the rows untouched) unless ``prefetch_into_free_rows=True`` says that the rows a
    prefetch names hold nothing the engine needs until the prefetch is OK (freshly
    allocated blocks, as vLLM's loads). ``checksum=True`` and a device cache over a transport
    that does not read device memory refuse ``"in_place"`` (``auto`` stays staged).
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
        path: str = "auto",
        prefetch_into_free_rows: bool = False,
        put_in_background: bool = False,
    ):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        workers = check_positive_int(workers, "workers")
        alloc_timeout = check_seconds(alloc_timeout, "alloc_timeout", none_ok=True,
                                      zero_ok=True)
        self.kv = kv
        self.store = store
        self._put_takes_detect_exists = _takes_keyword(getattr(store, "put", None),
                                                       "detect_exists")
        # An in-place get waits for a read given up anyway (its rows go back to the engine
        # only then): where the store can, the read runs on the job's thread, no hand-off,
        # unless that is the main thread (a caller that ran the job itself), where Mooncake's
        # reads measured slower than the hand-off saves (bench/results/
        # cpu-amd-epyc-2c-20261205-watched-calls).
        self._in_place_get_options = _until_returned(getattr(store, "get", None))
        # The same for an in-place put in the background (on a put worker): it ends once
        # Mooncake let go of the rows (a put given up too; what it stored late is removed
        # then), as the engine, which holds the rows until the put ends, would wait anyway.
        # A put on the caller's thread (CPU, put_in_background off) keeps the bound.
        self._in_place_put_options = _until_returned(getattr(store, "put", None))
        if not isinstance(prefetch_into_free_rows, bool):
            raise TypeError(f"prefetch_into_free_rows must be a bool, got "
                            f"{prefetch_into_free_rows!r}")
        if not isinstance(put_in_background, bool):
            raise TypeError(f"put_in_background must be a bool, got {put_in_background!r}")
        self.put_in_background = put_in_background
        # Every argument is checked before anything is registered with the store or probed.
        check_positive_int(page_tokens, "page_tokens")
        check_positive_int(staging_slots, "staging_slots")
        check_layout(layout, LAYOUTS)
        resolve_backend(backend, kv.row_pool.device)
        path = check_path(path)
        if raw_keys and key_prefix:
            raise ValueError(f"key_prefix must be empty with raw_keys=True, got {key_prefix!r}")
        self.keyspace = (RawKeys() if raw_keys
                         else KeySpace(kv, page_tokens, key_prefix, checksum=checksum,
                                       layout=layout))
        self.path_choice = self._choose_path(path, page_tokens, staging_slots, backend, layout,
                                             checksum, prefetch_into_free_rows)
        wanted = "in_place" in (self.path_choice.evict, self.path_choice.prefetch)
        self._rows = self._register_rows(page_tokens, layout, asked=path) if wanted else None
        try:
            self._build(page_tokens, staging_slots, backend, layout, checksum, workers,
                        alloc_timeout, check)
        except BaseException:
            for pool in (getattr(self, "_executor", None), getattr(self, "_put_executor", None)):
                if pool is not None:  # its workers, started already, end (no job queued)
                    pool.shutdown(wait=False)
            self._unregister_rows()  # the KV memory is not left registered with the store
            raise

    def _build(self, page_tokens, staging_slots, backend, layout, checksum, workers,
               alloc_timeout, check) -> None:
        """The rest of ``__init__``, once the path is chosen (and the KV rows registered
        where it is in place): staging, prepared copies, streams, workers."""
        kv, store = self.kv, self.store
        choice = self.path_choice  # staged after all where the store refused the KV memory
        self.path = choice.path
        self._evict_rows = self._rows if choice.evict == "in_place" else None
        self._prefetch_rows = self._rows if choice.prefetch == "in_place" else None
        in_place = self.path == "in_place"
        self.staging = StagingBuffer(kv, num_slots=1 if in_place else staging_slots,
                                     page_tokens=page_tokens,
                                     trailer_bytes=TRAILER_BYTES if checksum else 0,
                                     layout=layout)
        self._checksum = PageChecksum(self.staging) if checksum else None
        self.page_tokens = page_tokens
        self._page_rows = np.arange(page_tokens)  # a page's row numbers, for masks
        self.device = kernel_device(kv.row_pool, self.staging.row_pool)
        resolve_backend(backend, self.device)  # validates; "auto" is resolved per buffer
        self.backend = backend
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
        # A layer-wise scatter, group by group: (its copy, the layer after the group)
        self._scatter_groups = [
            (prepared_copy(*pools[::-1], list(range(first, end)), direction="scatter",
                           **common), end)
            for first, end in layer_groups(kv.max_layers)]
        self._evict_stream = torch.cuda.Stream(self.device) if cuda else None
        self._prefetch_stream = (torch.cuda.Stream(self.device, priority=-100) if cuda
                                 else None)
        if cuda:
            if any("two_hop" in p.backends for p in (self._gather, self._scatter_all)):
                self._rings = prepare_rings(kv.row_pool, self.staging.num_rows)
            self._warm_up()
        self._executor = JobThreads(workers, "kvmove")
        # Puts never wait for slots; prefetch jobs do: on one pool, prefetches waiting for
        # slots could hold every worker while the puts that free them wait in the queue.
        self._put_executor = JobThreads(workers, "kvmove-put")
        # Every thread the calls use starts now, not in a first call (~0.1 ms each): the
        # workers; threads for the store's calls (for a call on each worker and one on a
        # caller's thread, as far as the process's runner keeps idle threads) and its
        # watchdog; on the CPU, the helpers of large host copies (where they split).
        for pool in (self._executor, self._put_executor):
            pool.start_all()
        start_call_threads(2 * workers + 1)
        if not cuda:
            start_helpers()
        self._lock = threading.Lock()
        # transfers running on callers' threads: in-place puts (CPU evict), and prefetches
        # a waiter runs itself
        self._inline = 0
        self._inline_done = threading.Condition(self._lock)
        self._stats = MoverStats(statuses={s: 0 for s in Status})
        self._closed = False
        self._late_slots = 0  # staging slots held for store calls given up (see _free_after)
        # Store keys of in-place puts given up whose Mooncake call has not returned (see
        # _forget_when_done): a new put of one is not sent meanwhile.
        self._late_keys: set[str] = set()
        store.register(self.staging)
        log_choice(self.path_choice)

    def _choose_path(self, path, page_tokens, staging_slots, backend, layout, checksum,
                     free_rows):
        """The :class:`~kvmove.mover.path_choice.PathChoice` for ``path`` (the arguments the probe
        uses are checked already)."""

        def scratch_mover(cache, path, slots):
            return KVMover(cache, self.store, page_tokens=page_tokens, staging_slots=slots,
                           backend=backend, layout=layout, workers=1, path=path)

        return resolve(path, self.kv, self.store, page_tokens=page_tokens, layout=layout,
                       checksum=checksum, prefetch_into_free_rows=free_rows,
                       probe=lambda: probe(self.kv, self.store, page_tokens=page_tokens,
                                           layout=layout, make_mover=scratch_mover,
                                           pages=staging_slots))

    def _register_rows(self, page_tokens: int, layout: str, asked: str) -> InPlaceRows | None:
        """The KV rows described in place, their memory registered with the store. Where
        the store refuses the memory, ``auto`` falls back to staging (``path_choice`` says
        why); ``path="in_place"`` raises the store's error."""
        rows = InPlaceRows(self.kv, page_tokens, layout)
        try:
            self.store.register(rows)
        except StoreError as e:
            rows.close()
            if asked != "auto":
                raise
            self.path_choice = PathChoice.both("staged", f"auto: in place, but the store "
                                                         f"refused the KV memory ({e})")
            return None
        return rows

    def _warm_up(self) -> None:
        """Compile (or load) every kernel the mover launches, and allocate the two-hop rings,
        before serving: launches of each prepared copy that skip their only row. Everything
        runs on the evict stream, the skip rows made there too: made on the caller's stream
        they could be read before they are written (a live cache: rows written)."""
        with torch.cuda.stream(self._evict_stream):
            for prepared in (self._gather, self._scatter_all,
                             *(copy for copy, _ in self._scatter_groups)):
                prepared.warm_up()
        self._evict_stream.synchronize()

    # -- public ---------------------------------------------------------------------------
    def evict(self, keys, token_pages, *, valid_tokens=None,
              detect_exists: bool | None = None, wait_for_staging: bool = True) -> Transfer:
        """Gather the pages ``token_pages`` ``[n, page_tokens]`` (``-1`` = padding) into
        staging and put them under ``keys`` in the background. ``valid_tokens`` (an int or
        one per key) stores a partial last page. Returns once the gather is enqueued (CUDA)
        or done (CPU); ``Transfer.gathered`` tells when the KV rows may be overwritten.
        ``detect_exists`` (default: the store's setting) is handed to the store's put:
        ``False`` skips the master's exists query before the put (one request less, for
        keys the caller knows are new): a key stored already then ends ``OK``, not
        ``EXISTS`` (and counts as put in ``stats()``), and keeps its object, unless an
        in-place put of it is given up: Mooncake's ``0`` for it then reads as stored by
        that call, which is removed once it returns (a later ``MISS``, never bytes of two
        moments). It needs a store whose ``put`` takes it. ``wait_for_staging=False``: the
        call never waits for staging slots on the caller's thread (an engine's step must not
        wait on other transfers): where the staging lacks slots for its first piece it
        raises :class:`StagingFull` at once, and the keys of a later piece that finds none
        end ``FAILED`` (``STAGING_TIMEOUT``)."""
        if not isinstance(wait_for_staging, bool):
            raise TypeError(f"wait_for_staging must be a bool, got {wait_for_staging!r}")
        if detect_exists is not None:
            if not isinstance(detect_exists, bool):
                raise TypeError(f"detect_exists must be None or a bool, got {detect_exists!r}")
            if not self._put_takes_detect_exists:
                raise TypeError(f"detect_exists={detect_exists}: the store's put "
                                f"({type(self.store).__name__}) takes no detect_exists")
        call = self._take_call(keys, token_pages, valid_tokens, gathering=True)
        call.detect_exists = detect_exists
        transfer = Transfer(call.keys, kind="evict", num_layers=self.kv.max_layers,
                            device=self.device)
        if self._evict_rows is not None:
            return self._evict_in_place(call, transfer)
        size = self.staging.num_slots
        timeout = self.alloc_timeout if wait_for_staging else 0
        for first in range(0, len(call.keys), size):
            piece = call.piece(first, min(len(call.keys), first + size))
            # A later piece that cannot start fails its keys instead of raising: the pieces
            # before it are in flight, and their statuses must reach the caller.
            try:
                slots = self.staging.alloc(len(piece.keys), timeout=timeout)
            except StagingFull:
                if first == 0:
                    raise
                transfer.add_piece(first, self._unstaged(len(call.keys) - first, timeout))
                break
            except Exception as e:
                if first == 0:
                    raise
                transfer.add_piece(first, self._not_started(len(call.keys) - first, e))
                break
            gathered = None
            try:
                t0 = time.perf_counter()
                gathered = self._run_gather(piece, slots, call.ordered)  # every piece waits
                gather_s = time.perf_counter() - t0
                future = self._submit(self._put_job, piece, slots, gathered, gather_s,
                                      executor=self._put_executor)
            except BaseException as e:
                if gathered is not None:  # a CUDA gather may still be writing into the slots
                    gathered.synchronize()
                self.staging.free(slots)
                if first == 0 or not isinstance(e, Exception):
                    raise
                transfer.add_piece(first, self._not_started(len(call.keys) - first, e))
                break
            transfer.add_piece(first, future)
            if gathered is not None:
                transfer.gathered = gathered
        return transfer

    def prefetch(self, keys, token_pages, *, layerwise: bool = False,
                 valid_tokens=None) -> Transfer:
        """Get ``keys`` into staging in the background and scatter the pages whose status is
        OK into ``token_pages`` ``[n, page_tokens]`` (``-1`` = leave that KV row alone). With
        ``layerwise=True`` the scatter runs layer by layer, in groups that double
        (:func:`layer_groups`), and ``Transfer.wait_layer(l)`` returns as soon as layer
        ``l`` is in place. Rows of missing or failed keys are left untouched.
        ``valid_tokens`` must match what the pages were evicted with; a page's rows past its
        valid tokens are left alone (the object does not hold them). Returns as soon as the
        work is scheduled; a ``wait()`` without a timeout that finds no worker started
        on it yet runs it on the waiting thread, as does an unbounded ``wait_layer()``
        (except on a staged layer-wise prefetch, whose ``wait_layer()`` waits for a worker)."""
        call = self._take_call(keys, token_pages, valid_tokens, gathering=False)
        transfer = Transfer(call.keys, kind="prefetch", num_layers=self.kv.max_layers,
                            device=self.device)
        # A caller that waits before a worker has picked the job up runs it itself, with no
        # thread hand-off on its way. On a machine whose idle cores are slow to wake, a
        # worker woken after a rest also copies slower for a while: a staged get then
        # scattered 1.7x slower on a worker than on the waiting caller
        # (bench/results/cpu-amd-epyc-2c-20261205-spans-built). Staged and layer by layer,
        # only a whole wait() runs it: a wait_layer() caller wants its first layer while the
        # next ones are scattered, so it waits for a worker.
        job = StealableJob(partial(self._get_in_place if self._prefetch_rows is not None
                                   else self._get_job, call, layerwise, transfer.progress),
                           self._inline_run,
                           for_layer_waiters=self._prefetch_rows is not None or not layerwise)
        self._start(job)
        transfer.add_piece(0, job)
        return transfer

    # -- the call -------------------------------------------------------------------------
    def _take_call(self, keys, token_pages, valid_tokens, *, gathering: bool) -> Call:
        """Validate a call's arguments (once) and take what the background work needs:
        a copy of the indices made now, and on CUDA an event after the caller's work."""
        if self._closed:
            raise KVMoveError("the KVMover is closed")
        keys = check_keys(keys)
        n = len(keys)
        if isinstance(token_pages, np.ndarray):  # taken as it is, no tensor made
            pages = check_index_array(token_pages, "token_pages", dim=2)
        else:
            pages = as_index_tensor(token_pages, "token_pages", dim=2, device=self.device)
        if pages.shape[0] != n:
            raise ValueError(f"token_pages has {pages.shape[0]} pages for {n} keys")
        if n and pages.shape[1] != self.page_tokens:
            raise ValueError(
                f"token_pages has {pages.shape[1]} tokens per page, the mover's "
                f"page_tokens is {self.page_tokens}"
            )
        valid = check_valid_tokens(valid_tokens, n, self.page_tokens)
        if valid.flags.writeable:  # may be the caller's memory, which it may reuse at once
            valid = valid.copy()
        limit = self.kv.num_slots
        if isinstance(pages, torch.Tensor) and pages.is_cuda:
            # copied and checked on the caller's stream: no host reads
            pages = pages.to(torch.int64, copy=True)
            bad = ((pages < -1) | (pages >= limit)).any(dim=1) if n else None
        else:  # kept as numpy: a torch tensor is made only where a copy kernel needs one
            if isinstance(pages, torch.Tensor):
                pages = pages.numpy()
            host = pages.astype(np.int64, copy=True)  # the engine may reuse its own
            bad = None
            if n and self.check:
                if not small_rows_ok(host, limit, unique=not gathering):
                    checked = torch.from_numpy(host)
                    check_range(checked, limit, "token_pages")  # raises, naming the bad one
                    if not gathering:
                        check_unique(checked, "token_pages")
            elif n:
                out = ((host < -1) | (host >= limit)).any(axis=1)
                bad = out if out.any() else None
            pages = host
        ordered = None
        if self._evict_stream is not None:  # on CUDA
            caller = torch.cuda.current_stream(self.device)
            ordered = torch.cuda.Event()
            ordered.record(caller)
            # device indices: made on the caller's stream, used on the mover's
            if isinstance(pages, torch.Tensor):
                pages.record_stream(self._evict_stream if gathering else self._prefetch_stream)
                if bad is not None:
                    bad.record_stream(self._evict_stream if gathering
                                      else self._prefetch_stream)
        return Call(keys, pages, valid, bad, ordered)

    def _unstaged(self, n: int, timeout: float | None) -> TransferResult:
        log.warning("no staging slots came free within %s s: %d keys not moved", timeout, n)
        return TransferResult([Status.FAILED] * n, [STAGING_TIMEOUT] * n, 0)

    def _not_started(self, n: int, error: Exception) -> TransferResult:
        """The result of the last ``n`` keys of an evict whose earlier pieces are in flight
        when the next one could not start (the mover closed meanwhile, or an error)."""
        closed = self._closed
        log.log(logging.WARNING if closed else logging.ERROR,
                "%d keys of an evict not moved: %s", n,
                "the KVMover was closed during the call" if closed else repr(error),
                exc_info=None if closed else error)
        code = MOVER_CLOSED if closed else CLIENT_EXCEPTION
        return TransferResult([Status.FAILED] * n, [code] * n, 0)

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
        self._put_executor.shutdown(wait=True)
        with self._inline_done:  # transfers on callers' threads
            self._inline_done.wait_for(lambda: self._inline == 0)
        if not first:
            return
        with self._lock:
            late, late_keys = self._late_slots, len(self._late_keys)
        if late or late_keys:  # the last store call given up releases it all when it returns
            log.warning("closing the mover: %d staging slots and the KV rows of %d keys of "
                        "in-place puts given up stay registered until their store calls "
                        "return (Mooncake's cap is 60 s)", late, late_keys)
            return
        self._release_staging()

    def _unregister_rows(self) -> None:
        """Unregister the KV rows described in place (if any) and free their padding."""
        if self._rows is None:
            return
        unregister = getattr(self.store, "unregister", None)
        if unregister is not None:
            try:
                unregister(self._rows)
            except Exception as e:
                log.warning("unregistering the KV rows failed: %s", e)
        self._rows.close()

    def _release_staging(self) -> None:
        unregister = getattr(self.store, "unregister", None)
        if unregister is not None:
            try:
                unregister(self.staging)
            except Exception as e:  # the store may already be closed or its master gone
                log.warning("unregistering the staging failed: %s", e)
        self._unregister_rows()
        # Every transfer has ended (the executor is shut down), so every slot is free: a
        # slot still allocated here is the caller's own (staging.alloc), in use or not.
        self.staging.close(timeout=5.0)

    def _free_after(self, slots: torch.Tensor, late) -> None:
        """Return ``slots`` to the staging, at once or, when a store call on them was given
        up (``late``: its future), only once that call has really returned: until then
        Mooncake may still write into (get) or read from (put) their memory."""
        if late is None or late.done():
            self.staging.free(slots)
            return
        with self._lock:
            self._late_slots += len(slots)
        log.warning("%d staging slots held until a store call given up on them returns",
                    len(slots))
        late.add_done_callback(lambda _f: self._late_freed(slots))

    def _late_freed(self, slots: torch.Tensor) -> None:
        self.staging.free(slots)
        with self._lock:
            self._late_slots -= len(slots)
            last = self._closed and self._late_slots == 0 and not self._late_keys
        if last:
            self._release_staging()

    def __enter__(self) -> KVMover:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps ----------------------------------------------------------------------------
    def _run_gather(self, piece: Call, slots: torch.Tensor, ordered):
        """Enqueue (CUDA) or run (CPU) the gather of a piece; on CUDA the event after it."""
        if self._evict_stream is None:
            copy_pages(self._gather, piece.index_tensor(), slots, None)
            return None
        with torch.cuda.stream(self._evict_stream):
            if ordered is not None:
                self._evict_stream.wait_event(ordered)
            copy_pages(self._gather, piece.index_tensor(), slots, None)
            piece.fetch_bad()
            piece.fetch_pages()  # the put job finds the padding on the host (_zero_padding)
            event = torch.cuda.Event(blocking=True)  # a worker sleeps on it, never spins
            event.record(self._evict_stream)
        return event

    def _describe(self, slots: torch.Tensor, store_keys: list[str], valid: np.ndarray
                  ) -> Descriptors:
        """The objects' descriptors (``store_keys``: the keys as stored, see
        :class:`~kvmove.objects.keys.KeySpace`); with checksums, each ends with its slot's
        trailer."""
        desc = describe_trusted(self.staging, slots.numpy(), store_keys, valid)
        if self._checksum is None or len(desc) == 0:
            return desc
        trailer = self.staging.trailer
        return desc.with_trailer((slots * trailer.shape[1] + trailer.data_ptr()).tolist(),
                                 trailer.shape[1])

    @contextlib.contextmanager
    def _begin_put(self, store_keys: list[str], options: dict):
        """A put of ``store_keys`` whose exists check starts now, while the gather ends and
        the descriptors are made (``MooncakeStore.begin_put``): yields the put to call with
        them. A store without ``begin_put``, or one that cannot begin (closed): yields its
        plain ``put``, whose failure then ends the keys' statuses as any put's does. In
        place the put checks inside it: there is no gather to overlap there, and an early
        check measured no faster. ``options``: the put's keyword arguments
        (:func:`_put_options`)."""
        begin = getattr(self.store, "begin_put", None)
        pending = None
        if begin is not None:
            try:
                pending = begin(store_keys, **options)
            except Exception as e:
                log.debug("begin_put of %d keys: %s; a plain put follows", len(store_keys), e)
        if pending is None:
            yield partial(self.store.put, **options) if options else self.store.put
            return
        with pending:
            yield pending.put

    def _submit(self, fn, *args, executor=None) -> Future:
        """Queue ``fn(*args)`` as a background job, unless the mover was closed meanwhile
        (then the caller frees its slots and the call raises ``KVMoveError``)."""
        with self._lock:
            if self._closed:
                raise KVMoveError("the KVMover is closed")
            return (executor or self._executor).submit(fn, *args)

    def _start(self, job: StealableJob) -> None:
        """:meth:`_submit` of a job that reports its own result: queued as it is, with no
        second future around it."""
        with self._lock:
            if self._closed:
                raise KVMoveError("the KVMover is closed")
            self._executor.start(job)

    def _count(self, result: TransferResult, *, put: bool) -> None:
        with self._lock:
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

    # -- background jobs ------------------------------------------------------------------
    def _put_job(self, piece: Call, slots: torch.Tensor, gathered, gather_s: float
                 ) -> TransferResult:
        times = StageTimes(gather=gather_s)
        n = len(piece.keys)
        statuses, codes = [Status.FAILED] * n, [BAD_ROWS] * n
        late = None
        try:
            store_keys = self.keyspace.store_keys(piece.keys)
            # the master answers which keys exist while the gather ends and the put is made
            with self._begin_put(store_keys, _put_options(piece)) as put:
                if gathered is not None:
                    gathered.synchronize()
                bad = piece.bad_on_host()
                good = _stored_keys(bad, n)
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
                got, got_codes, late, _ = self._store_call(put, desc)
                times.put = time.perf_counter() - t0
            for i, st, code in zip(good.tolist(), got, got_codes, strict=True):
                statuses[i], codes[i] = st, code
        finally:
            self._free_after(slots, late)
        result = TransferResult(statuses, codes, _ok_bytes(desc, got), times)
        self._count(result, put=True)
        return result

    def _zero_padding(self, piece: Call, slots: torch.Tensor) -> None:
        """Zero the staging rows of the ``-1`` entries within a page's valid tokens: the
        gather skips them, and an object holds zeros there whichever the path (in place
        they are read from a zero row), never what the slot held before (another key's
        rows). One compare over the pages when there is no such entry."""
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

    def _get_job(self, call: Call, layerwise: bool, progress: LayerProgress) -> TransferResult:
        results, event = [], None
        try:
            n, size = len(call.keys), self.staging.num_slots
            for first in range(0, n, size):
                last = min(n, first + size)
                try:
                    slots = self.staging.alloc(last - first, timeout=self.alloc_timeout)
                except StagingFull:
                    results.append(self._unstaged(n - first, self.alloc_timeout))
                    break
                late = []
                try:
                    result, event = self._get_piece(
                        call.piece(first, last), slots, layerwise and last == n, progress,
                        call.ordered, late)  # every piece: the first may scatter nothing
                finally:
                    self._free_after(slots, late[0] if late else None)
                results.append(result)
            progress.all_done(event)
        finally:
            progress.finish()
        return join_results(results) if results else TransferResult([], [], 0)

    def _get_piece(self, piece: Call, slots: torch.Tensor, layerwise: bool,
                   progress: LayerProgress, ordered, late: list
                   ) -> tuple[TransferResult, object]:
        times = StageTimes()
        t0 = time.perf_counter()
        desc = self._describe(slots, self.keyspace.store_keys(piece.keys), piece.valid)
        statuses, codes, given_up, _ = self._store_call(self.store.get, desc)
        late.append(given_up)  # a get given up may still write into these slots
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
        row), each page's first ``valid`` rows (the rows past them, which the object does not
        hold, are left alone, as a get in place leaves them): all layers, or group of layers by
        group (:func:`layer_groups`) reporting each to ``progress``. Returns on the CPU once
        copied, on CUDA once the copy has finished on the prefetch stream (the staging slots
        are freed after it); returns the CUDA event after it, or None."""
        stream = self._prefetch_stream
        if not ok.any():
            return None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if ordered is not None:
                stream.wait_event(ordered)
            pages = piece.index_tensor()
            device_bad = isinstance(piece.bad, torch.Tensor)
            keep = None if ok.all() else ok[:, None]  # [n, 1] or [n, page_tokens]
            short = piece.valid < self.page_tokens
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
            plan = plan_pages(self._scatter_all, pages, slots)  # one plan for every layer
            for prepared, end in (self._scatter_groups if layerwise
                                  else ((self._scatter_all, None),)):
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
        """Mark FAILED (code -801) every OK key whose bytes do not match its checksum."""
        got = [i for i, s in enumerate(statuses) if s is Status.OK]
        if not got:
            return
        idx = torch.tensor(got, dtype=torch.int64)
        valid = torch.from_numpy(valid[got])  # a copy: the call's array may be read-only
        for i, good in zip(got, self._checksum.matches(slots[idx], valid).tolist(), strict=True):
            if not good:
                statuses[i], codes[i] = Status.FAILED, CHECKSUM_MISMATCH
                log.warning("object %s failed its checksum; not scattered", i)

    def _store_call(self, op, desc: Descriptors, **options
                    ) -> tuple[list[Status], list[int], object, object]:
        """Run a store put/get (``options``: its keyword arguments); an exception becomes
        FAILED for every key, never lost. The third item is the future of store calls
        given up on this memory, or None; the fourth a put's ``late_stored`` (the keys those
        calls stored after all), or None."""
        if len(desc) == 0:
            return [], [], None, None
        try:
            statuses = op(desc, **options)
        except Exception as e:
            log.warning("%s of %d keys failed: %s", getattr(op, "__name__", "store call"),
                        len(desc), e)
            return [Status.FAILED] * len(desc), [-1] * len(desc), None, None
        codes = getattr(statuses, "codes", None)  # a default argument would be built always
        codes = (list(codes) if codes is not None
                 else [0 if s is Status.OK else -1 for s in statuses])
        return (list(statuses), codes, getattr(statuses, "late", None),
                getattr(statuses, "late_stored", None))


    # -- the in-place path ----------------------------------------------------------------
    def _evict_in_place(self, call: Call, transfer: Transfer) -> Transfer:
        """Put the pages straight from the KV rows. On the CPU the put runs here: ``evict``
        returns once the store has read the rows (so, as on the staged path, the engine may
        overwrite them then). On CUDA, or with ``put_in_background``, it runs in the
        background (after the caller's work), and ``transfer.gathered`` completes when it
        ends."""
        if self.device.type != "cuda" and not self.put_in_background:
            with self._inline_run() as allowed:
                if not allowed:
                    raise KVMoveError("the KVMover is closed")
                transfer.add_piece(0, self._put_in_place(call))
            return transfer
        future = self._submit(self._put_in_place, call, True, executor=self._put_executor)
        transfer.add_piece(0, future)
        transfer.gathered = FutureEvent(future)
        return transfer

    @contextlib.contextmanager
    def _inline_run(self):
        """Count a transfer that runs on a caller's thread (``close()`` waits for them);
        yields False, counting nothing, once the mover is closed."""
        with self._lock:
            allowed = not self._closed
            self._inline += allowed
        try:
            yield allowed
        finally:
            if allowed:
                with self._inline_done:
                    self._inline -= 1
                    self._inline_done.notify_all()

    def _put_in_place(self, call: Call, background: bool = False) -> TransferResult:
        """The put of an in-place evict, on the caller's thread or, ``background``, on a put
        worker (the engine holds the rows until it ends: there it waits for a put given up
        to return, see ``_in_place_put_options``)."""
        n = len(call.keys)
        statuses, codes = [Status.FAILED] * n, [BAD_ROWS] * n
        pages, bad = self._host_pages(call, self._evict_stream)
        if bad is None:  # the usual case: every key, as called (no per-key selection)
            good = None  # the positions of the keys described: all of them
            desc = self._evict_rows.describe_trusted(
                pages, self.keyspace.store_keys(call.keys), call.valid, get=False)
        else:
            good = _stored_keys(bad, n)
            desc = self._evict_rows.describe_trusted(
                pages[good], self.keyspace.store_keys([call.keys[i] for i in good.tolist()]),
                call.valid[good], get=False)
        pending = self._late_keys
        if pending:  # a put of these keys given up earlier may still store them
            held = np.fromiter((k in pending for k in desc.keys), dtype=bool, count=len(desc))
            if held.any():
                log.warning("evict: %d keys not stored: an earlier in-place put of them was "
                            "given up and has not returned", int(held.sum()))
                if good is None:
                    good = np.arange(n)
                for i in good[held].tolist():
                    codes[i] = CALL_TIMEOUT
                good = good[~held]
                desc = desc.select(np.flatnonzero(~held).tolist())
        t0 = time.perf_counter()
        options = _put_options(call)
        if background:
            options.update(self._in_place_put_options)
        got, got_codes, _, late_stored = self._store_call(self.store.put, desc, **options)
        times = StageTimes(put=time.perf_counter() - t0)
        if len(got) == n:  # every key was put
            statuses, codes = got, got_codes
        else:  # some were not (good is set: bad rows, or keys held)
            for i, st, code in zip(good.tolist(), got, got_codes, strict=True):
                statuses[i], codes[i] = st, code
        if late_stored is not None:
            self._forget_when_done(late_stored, [k for k, c in zip(desc.keys, got_codes,
                                                                   strict=True)
                                                 if c == CALL_TIMEOUT])
        result = TransferResult(statuses, codes, _ok_bytes(desc, got), times)
        self._count(result, put=True)
        return result

    def _forget_when_done(self, late_stored, keys: list[str]) -> None:
        """An in-place put given up still reads the KV rows until Mooncake returns, and the
        engine may have written them meanwhile (its evict ended FAILED): once the call has
        returned, remove what it stored after all (``late_stored``; never a key it did not
        store: that may hold a good object of an earlier put), so no key holds bytes of two
        moments. Until then a new in-place put of ``keys`` is not sent (it ends FAILED), and
        the KV rows (and their zero row) stay registered. ``keys`` is never empty (the keys
        of the call given up) and never shares a key with another pending put's."""
        with self._lock:
            self._late_keys.update(keys)

        def remove(future) -> None:
            stored = future.result()
            try:
                if stored:
                    self.store.remove(stored, force=True)
            except Exception as e:  # the store may be closed by then
                log.warning("removing %d keys of an in-place put given up failed: %s",
                            len(stored), e)
            finally:
                with self._lock:
                    self._late_keys.difference_update(keys)
                    last = self._closed and self._late_slots == 0 and not self._late_keys
                if last:  # close() left the release to the last call given up
                    self._release_staging()

        late_stored.add_done_callback(remove)

    def _get_in_place(self, call: Call, layerwise: bool, progress: LayerProgress
                      ) -> TransferResult:
        """Get the objects straight into the KV rows: every layer lands with the get (a
        layer-wise prefetch reports them all at once). Keys with out-of-range rows read
        into the discard row, so that their status is the store's, as when staged, then
        end FAILED (``BAD_ROWS``) if they were OK."""
        try:
            pages, bad = self._host_pages(call, self._prefetch_stream)
            desc = self._prefetch_rows.describe_trusted(pages,
                                                        self.keyspace.store_keys(call.keys),
                                               call.valid, get=True, bad=bad)
            t0 = time.perf_counter()
            options = (self._in_place_get_options
                       if threading.current_thread() is not threading.main_thread() else {})
            statuses, codes, late, _ = self._store_call(self.store.get, desc, **options)
            if late is not None:
                # A get given up may still write into the KV rows until Mooncake returns
                # (at most its own transfer timeout, 60 s): the prefetch ends only then,
                # so that no late byte lands in rows the engine took back.
                log.warning("in-place prefetch: a store call was given up; waiting for it "
                            "to return before the rows go back to the engine")
                wait_until_returned(late)
            times = StageTimes(get=time.perf_counter() - t0)
            if bad is not None:
                ok = np.fromiter((s is Status.OK for s in statuses), dtype=bool,
                                 count=len(statuses))
                _fail_bad(bad & ok, statuses, codes)
            result = TransferResult(statuses, codes, _ok_bytes(desc, statuses), times)
            self._count(result, put=False)
            progress.all_done(None)
            return result
        finally:
            progress.finish()

    def _host_pages(self, call: Call, stream) -> tuple[np.ndarray, np.ndarray | None]:
        """The call's pages on the host and its keys with an out-of-range row (or None). On
        CUDA this first waits, on ``stream``, for the caller's work at call time (which
        wrote the rows and the indices), then reads the indices: in the background, never
        on the caller's thread."""
        pages = call.pages
        if isinstance(pages, np.ndarray):  # host indices, copied (and checked) at call time
            if call.ordered is not None:  # device rows: the caller's work wrote them
                call.ordered.synchronize()
            return pages, call.bad
        with torch.cuda.stream(stream):
            stream.wait_event(call.ordered)
            pages = pages.to("cpu")
        stream.synchronize()
        host = pages.numpy()
        out = ((host < -1) | (host >= self.kv.num_slots)).any(axis=1)
        return host, out if out.any() else None


@dataclass
class Call:
    """A call's arguments, validated and taken at call time (or a piece of them)."""

    keys: list[str]
    # int64 [n, page_tokens]: a copy made at call time, numpy on the host, else a tensor on
    # the device
    pages: np.ndarray | torch.Tensor
    valid: np.ndarray  # int64 [n] valid tokens per key
    bad: np.ndarray | torch.Tensor | None  # bool [n]: a row of the key's page out of range
    ordered: object = None  # CUDA event after the caller's work at call time
    detect_exists: bool | None = None  # an evict's, for the store's put (None: its default)
    _bad_host: torch.Tensor | None = None
    _pages_host: torch.Tensor | None = None

    def piece(self, first: int, last: int) -> Call:
        bad = None if self.bad is None else self.bad[first:last]
        return Call(self.keys[first:last], self.pages[first:last], self.valid[first:last],
                    bad, self.ordered, self.detect_exists)

    def index_tensor(self) -> torch.Tensor:
        """``pages`` as a tensor (the copy kernels' index argument), sharing its memory."""
        pages = self.pages
        return torch.from_numpy(pages) if isinstance(pages, np.ndarray) else pages

    def fetch_bad(self) -> None:
        """Enqueue the copy of a device ``bad`` mask to the host (on the current stream)."""
        if isinstance(self.bad, torch.Tensor):
            self._bad_host = self.bad.to("cpu", non_blocking=True)

    def fetch_pages(self) -> None:
        """Enqueue the copy of device ``pages`` to the host (on the current stream)."""
        if not isinstance(self.pages, np.ndarray):
            self._pages_host = self.pages.to("cpu", non_blocking=True)

    def pages_on_host(self) -> np.ndarray:
        """``pages`` on the host: after :meth:`fetch_pages` and a wait for the stream."""
        pages = self.pages
        return pages if isinstance(pages, np.ndarray) else self._pages_host.numpy()

    def bad_on_host(self) -> np.ndarray | None:
        """``bad`` on the host: after :meth:`fetch_bad` and a wait for the stream."""
        if isinstance(self.bad, torch.Tensor):
            return self._bad_host.numpy()
        return self.bad


def _put_options(call: Call) -> dict:
    """The keyword arguments of the store's put for ``call``'s keys."""
    return {} if call.detect_exists is None else {"detect_exists": call.detect_exists}


def _until_returned(fn) -> dict:
    """The keyword arguments that make the store call ``fn`` return only once Mooncake has
    (none where it takes no ``until_returned``)."""
    return {"until_returned": True} if _takes_keyword(fn, "until_returned") else {}


def _takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # not a callable, or one without a signature
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _stored_keys(bad: np.ndarray | None, n: int) -> np.ndarray:
    """The positions of an evict's keys that are stored: those without an out-of-range row
    (``bad``: one flag per key, or None for none), the others logged."""
    good = np.arange(n) if bad is None else np.flatnonzero(~bad)
    if good.size < n:
        log.warning("evict: %d of %d keys have out-of-range rows; not stored",
                    n - good.size, n)
    return good


def _fail_bad(bad: np.ndarray, statuses: list[Status], codes: list[int]) -> None:
    for i in np.flatnonzero(bad).tolist():
        statuses[i], codes[i] = Status.FAILED, BAD_ROWS
    if bad.any():
        log.warning("prefetch: %d keys have out-of-range rows; not scattered", int(bad.sum()))


def _ok_bytes(desc: Descriptors, statuses: list[Status]) -> int:
    if statuses.count(Status.OK) == len(statuses):  # the common case: one pass, in C
        return desc.total_bytes
    return sum(desc.nbytes(i) for i, s in enumerate(statuses) if s is Status.OK)
