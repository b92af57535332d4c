"""``KVMover``: the HiSparse evict (gather + put) and prefetch (get + scatter) paths. The
contract is ``docs/API.md``, "KVMover" and "The in-place path"."""

from __future__ import annotations

import logging

import torch

from kvmove.checks import check_layout, check_positive_int, check_seconds
from kvmove.errors import StoreError
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import LAYOUTS, StagingBuffer
from kvmove.metrics import record as metrics
from kvmove.mover.in_place_path import InPlaceEvict, InPlacePrefetch
from kvmove.mover.lifecycle import Lifecycle, MoverStats
from kvmove.mover.path_choice import (
    PathChoice,
    check_keep_failed_rows,
    check_path,
    log_choice,
    probe,
    resolve,
)
from kvmove.mover.request import RequestTaker
from kvmove.mover.staged_path import Copies, StagedEvict, StagedPrefetch, layer_groups
from kvmove.mover.transfer import Transfer
from kvmove.objects.checksum import TRAILER_BYTES, PageChecksum
from kvmove.objects.in_place import InPlaceRows
from kvmove.objects.keys import KeySpace, RawKeys
from kvmove.rows.prepared import kernel_device, resolve_backend
from kvmove.rows.torch_backend.host_copy import start_helpers
from kvmove.store.bounded_call import start_call_threads
from kvmove.store.protocol import Store
from kvmove.tuning.autotune import tune_for_copies

__all__ = ["KVMover", "MoverStats", "layer_groups"]

log = logging.getLogger(__name__)


class KVMover:
    """Evict KV pages of ``kv`` to ``store`` and prefetch them back.

    The mover owns a :class:`StagingBuffer` of ``staging_slots`` pages, registered with the
    store once, and every copy between it and the cache, prepared when it is built. Each
    ``evict`` / ``prefetch`` returns a :class:`Transfer` with one status per key, in order.
    ``path`` picks staged or in-place moves per direction, once, here (``mover.path``,
    ``mover.path_choice``). Arguments, statuses and ordering: ``docs/API.md``, "KVMover"."""

    def __init__(
        self,
        kv: KVCache,
        store: Store,
        *,
        page_tokens: int = 64,
        staging_slots: int = 1024,
        backend: str = "auto",
        key_prefix: str = "",
        tenant: str | None = None,
        workers: int = 2,
        alloc_timeout: float | None = 60.0,
        check: bool = True,
        checksum: bool = False,
        raw_keys: bool = False,
        layout: str = "layer_first",
        path: str = "auto",
        keep_failed_rows: bool = False,
        put_in_background: bool = False,
    ):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        workers = check_positive_int(workers, "workers")
        alloc_timeout = check_seconds(alloc_timeout, "alloc_timeout", none_ok=True,
                                      zero_ok=True)
        self.kv = kv
        self.store = store
        if not isinstance(put_in_background, bool):
            raise TypeError(f"put_in_background must be a bool, got {put_in_background!r}")
        self.put_in_background = put_in_background
        # Every argument is checked before anything is registered with the store or probed.
        check_positive_int(page_tokens, "page_tokens")
        check_positive_int(staging_slots, "staging_slots")
        check_layout(layout, LAYOUTS)
        resolve_backend(backend, kv.row_pool.device)
        path = check_path(path)
        check_keep_failed_rows(keep_failed_rows, path)
        if raw_keys and key_prefix:
            raise ValueError(f"key_prefix must be empty with raw_keys=True, got {key_prefix!r}")
        self.keyspace = (RawKeys(tenant) if raw_keys
                         else KeySpace(kv, page_tokens, key_prefix, checksum=checksum,
                                       layout=layout, tenant=tenant))
        self.path_choice = self._choose_path(path, page_tokens, staging_slots, backend, layout,
                                             checksum, keep_failed_rows)
        wanted = "in_place" in (self.path_choice.evict, self.path_choice.prefetch)
        self._rows = self._register_rows(page_tokens, layout, asked=path) if wanted else None
        self._life: Lifecycle | None = None
        try:
            self._build(page_tokens, staging_slots, backend, layout, checksum, workers,
                        alloc_timeout, check)
        except BaseException:
            if self._life is not None:  # its workers, started already, end (no job queued)
                self._life.abandon()
            self._unregister_rows()  # the KV memory is not left registered with the store
            raise

    def _build(self, page_tokens, staging_slots, backend, layout, checksum, workers,
               alloc_timeout, check) -> None:
        """The rest of ``__init__``, once the path is chosen (and the KV rows registered
        where it is in place): staging, prepared copies, streams, workers, the two paths."""
        kv, store = self.kv, self.store
        choice = self.path_choice  # staged after all where the store refused the KV memory
        self.path = choice.path
        self.staging = StagingBuffer(kv, num_slots=1 if self.path == "in_place"
                                     else staging_slots, page_tokens=page_tokens,
                                     trailer_bytes=TRAILER_BYTES if checksum else 0,
                                     layout=layout)
        self.page_tokens = page_tokens
        self.device = kernel_device(kv.row_pool, self.staging.row_pool)
        resolve_backend(backend, self.device)  # validates; "auto" is resolved per buffer
        self.backend = backend
        self.alloc_timeout = alloc_timeout
        self.check = check
        cuda = self.device.type == "cuda"
        # KVMOVE_AUTOTUNE=1 tunes here, before the copies are prepared (they read the tuned
        # configs), never inside a call (nothing to tune off CUDA).
        tune_for_copies(self.device, [kv.row_bytes(n) for n in kv.buffer_names], page_tokens)
        evict_stream = torch.cuda.Stream(self.device) if cuda else None
        prefetch_stream = torch.cuda.Stream(self.device, priority=-100) if cuda else None
        self._copies = Copies(kv, self.staging, backend=backend, page_tokens=page_tokens,
                              evict_stream=evict_stream)
        self._life = life = Lifecycle(workers, self.staging, store, self._release_staging)
        # Every thread the calls use starts now, not in a first call (~0.1 ms each): the
        # workers; threads for the store's calls (for a call on each worker and one on a
        # caller's thread, as far as the process's runner keeps idle threads) and its
        # watchdog; on the CPU, the helpers of large host copies (where they split).
        for pool in (life.executor, life.put_executor):
            pool.start_all()
        start_call_threads(2 * workers + 1)
        if not cuda:
            start_helpers()
        self._requests = RequestTaker(life=life, device=self.device, page_tokens=page_tokens,
                                      num_slots=kv.num_slots, check=check,
                                      evict_stream=evict_stream,
                                      prefetch_stream=prefetch_stream)
        self._num_layers = kv.max_layers
        self._checksum = PageChecksum(self.staging) if checksum else None
        self._evict_path = self._make_path(choice.evict, evict_stream, alloc_timeout,
                                           prefetching=False)
        self._prefetch_path = self._make_path(choice.prefetch, prefetch_stream,
                                              alloc_timeout, prefetching=True)
        store.register(self.staging)
        log_choice(choice)
        metrics.mover_built(self.staging, choice)

    def _make_path(self, path: str, stream, alloc_timeout, *,
                   prefetching: bool):
        """The object that carries out one direction's calls on ``path``."""
        if path == "in_place":
            shared = {"rows": self._rows, "keyspace": self.keyspace, "store": self.store,
                      "life": self._life, "stream": stream, "num_slots": self.kv.num_slots}
            if prefetching:
                return InPlacePrefetch(**shared)
            return InPlaceEvict(background=stream is not None or self.put_in_background,
                                **shared)
        kind = StagedPrefetch if prefetching else StagedEvict
        return kind(staging=self.staging, copies=self._copies, keyspace=self.keyspace,
                    store=self.store, life=self._life,
                    checksum=self._checksum,
                    stream=stream, alloc_timeout=alloc_timeout)

    def _choose_path(self, path, page_tokens, staging_slots, backend, layout, checksum,
                     keep_failed) -> PathChoice:
        """The :class:`~kvmove.mover.path_choice.PathChoice` for ``path`` (the arguments the
        probe uses are checked already)."""

        def scratch_mover(cache, path, slots):
            return KVMover(cache, self.store, page_tokens=page_tokens, staging_slots=slots,
                           backend=backend, layout=layout, workers=1, path=path)

        return resolve(path, self.kv, self.store, page_tokens=page_tokens, layout=layout,
                       checksum=checksum, keep_failed_rows=keep_failed,
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

    # -- public ---------------------------------------------------------------------------
    def evict(self, keys, token_pages, *, valid_tokens=None,
              detect_exists: bool | None = None, wait_for_staging: bool = True) -> Transfer:
        """Gather the pages ``token_pages`` ``[n, page_tokens]`` (``-1`` = padding) and put
        them under ``keys`` in the background; ``valid_tokens`` stores a partial last page.
        Returns once the gather is enqueued (CUDA) or done (CPU): ``Transfer.gathered``
        tells when the KV rows may be overwritten. ``detect_exists`` goes to the store's
        put; ``wait_for_staging=False`` never waits for staging slots (``docs/API.md``)."""
        started = metrics.clock()
        request = self._requests.take(keys, token_pages, valid_tokens, True, detect_exists,
                                      wait_for_staging)
        transfer = Transfer(request.keys, kind="evict", num_layers=self._num_layers,
                            device=self.device)
        transfer = self._evict_path.run(request, transfer)
        metrics.call_done("evict", started)
        return transfer

    def prefetch(self, keys, token_pages, *, layerwise: bool = False,
                 valid_tokens=None) -> Transfer:
        """Get ``keys`` in the background and scatter the pages whose status is OK into
        ``token_pages`` ``[n, page_tokens]`` (``-1`` = leave that row alone); rows of missing
        or failed keys are left untouched. ``layerwise=True``: ``Transfer.wait_layer(l)``
        returns once layer ``l`` is in place (:func:`layer_groups`). Returns once the work
        is scheduled; which waits run it on the waiting thread: ``docs/API.md``."""
        started = metrics.clock()
        request = self._requests.take(keys, token_pages, valid_tokens, False,
                                      layerwise=layerwise)
        transfer = Transfer(request.keys, kind="prefetch", num_layers=self._num_layers,
                            device=self.device)
        transfer = self._prefetch_path.run(request, transfer)
        metrics.call_done("prefetch", started)
        return transfer

    def stats(self) -> MoverStats:
        return self._life.stats()

    def close(self) -> None:
        """Wait for in-flight transfers, then unregister and free the staging. Idempotent.
        Calls racing with ``close()`` either run to the end before it returns or raise
        :class:`KVMoveError` (their staging slots returned)."""
        if self._life.close():
            self._release_staging()

    def __enter__(self) -> KVMover:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the end --------------------------------------------------------------------------
    def _unregister_rows(self) -> None:
        """Unregister the KV rows described in place (if any) and free their padding."""
        if self._rows is None:
            return
        try:
            self.store.unregister(self._rows)
        except Exception as e:
            log.warning("unregistering the KV rows failed: %s", e)
        self._rows.close()

    def _release_staging(self) -> None:
        try:
            self.store.unregister(self.staging)
        except Exception as e:  # the store may already be closed or its master gone
            log.warning("unregistering the staging failed: %s", e)
        self._unregister_rows()
        # Every transfer has ended (the workers are shut down), so every slot is free: a
        # slot still allocated here is the caller's own (staging.alloc), in use or not.
        self.staging.close(timeout=5.0)

