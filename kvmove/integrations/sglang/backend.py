"""``KVMoveStorage``: kvmove as an SGLang HiCache storage backend, loaded by SGLang's
``"dynamic"`` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"kvmove","module_path":"kvmove.integrations.sglang",
      "class_name":"KVMoveStorage","interface_v1":1}'

It stores exactly the objects and keys of SGLang's own Mooncake backend for the same storage
config, so a fleet that mixes the two shares objects, and answers SGLang's calls zero-copy
from the registered host pool (:class:`kvmove.HostPool` descriptors, a get counting only
when the object is exactly the page's size). MLA ``layer_first`` pages move through
staging where that is faster (:mod:`kvmove.integrations.sglang.staged`). See
``docs/API.md``, "SGLang".

SGLang is imported here only: importing :mod:`kvmove` never imports it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

import kvmove
from kvmove.integrations.sglang.keys import SGLangKeys
from kvmove.integrations.sglang.pools import PoolView, indexer_view, kv_view
from kvmove.integrations.sglang.staged import StagedPages, settings
from kvmove.integrations.sglang.storage_metrics import StorageFigures
from kvmove.integrations.sglang.store_config import store_config_for
from kvmove.memory.host_memory import HostMemory
from kvmove.objects.descriptors import concat, describe_trusted

if TYPE_CHECKING:
    from kvmove.store.protocol import Store

log = logging.getLogger(__name__)

__all__ = ["KVMoveStorage"]

_DONE = (kvmove.Status.OK, kvmove.Status.EXISTS)  # a page component that is stored
_LET_GO_S = 120.0  # longest wait for a stuck Mooncake call to return (its own cap: 60 s)


class KVMoveStorage(HiCacheStorage):
    """SGLang HiCache storage on a Mooncake store, through kvmove.

    ``storage_config``: SGLang's ``HiCacheStorageConfig``; ``kwargs``: what SGLang's
    factory passes (``{}``). The store comes from ``extra_config``
    (``master_server_address``, ...), ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or the
    ``MOONCAKE_*`` variables, as for SGLang's own Mooncake backend
    (:mod:`kvmove.integrations.sglang.store_config`). Raises ``ValueError`` for a configuration
    it does not serve (split heads, decode context parallelism) before connecting.
    """

    def __init__(self, storage_config, kwargs: dict | None = None):
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError("kvmove's SGLang backend does not serve split-head MHA storage "
                             "(tp_lcm_size != tp_size)")
        if int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
            raise ValueError("kvmove's SGLang backend does not serve decode context "
                             "parallelism (dcp_size > 1)")
        self.storage_config = storage_config
        # the path of layer_first MLA pages (:mod:`kvmove.integrations.sglang.staged`)
        self._path, self._staging_bytes = settings(getattr(storage_config, "extra_config",
                                                           None))
        self.keys = SGLangKeys(storage_config)
        self.is_mla = self.keys.is_mla
        self.store: Store = kvmove.MooncakeStore(store_config_for(storage_config))
        self.mem_pool_host = None
        self.kv: PoolView | None = None
        self.staged: StagedPages | None = None  # a layer_first MLA pool's staged path
        self.side: dict[str, PoolView] = {}
        self.registered_pools: dict[Any, Any] = {}
        self._bounce: HostMemory | None = None  # the legacy calls' registered copy buffer
        self._bounce_lock = threading.Lock()
        self._closed = False
        self.figures = StorageFigures(getattr(storage_config, "enable_storage_metrics", False))
        log.info("kvmove SGLang backend on master %s, key prefix %r, tenant %r",
                 self.store.address, self.keys.prefix, self.keys.tenant)

    # -- registration -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Register the anchor KV host pool's buffers with the store, once. Raises
        ``ValueError`` naming the pool kind and layout when kvmove does not serve it."""
        view = kv_view(mem_pool_host, is_mla=self.is_mla)
        for pool in view.components:
            self.store.register(pool)
        if self.staged is not None:  # a pool registered before: its staging goes
            old, self.staged = self.staged, None
            old.close()
        if self.is_mla and view.components[0].layout == "layer_first":
            try:
                self.staged = StagedPages(mem_pool_host.kv_buffer, view.page_size, self.store,
                                          path=self._path, staging_bytes=self._staging_bytes)
            except Exception as e:
                if self._path != "auto":
                    raise
                log.warning("kvmove SGLang backend: no staged path for the layer_first pool "
                            "(%s: %s); its pages move in place", type(e).__name__, e)
        self.mem_pool_host, self.kv = mem_pool_host, view

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Register a side pool. The anchor (``kv``) was registered by
        :meth:`register_mem_pool_host`; the DSA indexer pool is served; any other raises
        ``ValueError`` naming it."""
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return
        if name != str(PoolName.INDEXER):
            raise ValueError(f"kvmove's SGLang backend serves the DSA indexer side pool only, "
                             f"not {name!r} ({type(host_pool).__name__})")
        view = indexer_view(host_pool)
        for pool in view.components:
            self.store.register(pool)
        self.registered_pools[host_pool_name] = host_pool
        self.side[name] = view

    # -- helpers ----------------------------------------------------------------------------
    def _kv_view(self) -> PoolView:
        if self.kv is None:
            raise RuntimeError("no host pool registered: SGLang calls register_mem_pool_host "
                               "before any transfer")
        return self.kv

    @staticmethod
    def _pages(view: PoolView, object_keys: list[list[str]], host_indices):
        """The page numbers of ``host_indices``, checked: one page per object key of a
        component."""
        pages = view.pages_of(host_indices)
        if len(pages) != len(object_keys[0]):
            raise ValueError(f"{len(object_keys[0])} keys for {len(pages)} pages of "
                             f"host_indices")
        return pages

    def _describe(self, view: PoolView, object_keys: list[list[str]], host_indices):
        """Descriptors of every object of the pages ``host_indices``: component by
        component (``object_keys[c]`` names component ``c``'s objects, made by
        :class:`SGLangKeys`: non-empty strings). The pages are checked here, once. Objects
        of one span each are worked out from the view's :class:`PageSpans` (a few pages:
        in Python ints, checked there)."""
        spans = view.spans
        if spans is not None:
            pages = spans.few_pages(host_indices, len(object_keys[0]))
            if pages is None:
                pages = self._pages(view, object_keys, host_indices)
            return spans.describe(object_keys, pages)
        pages = self._pages(view, object_keys, host_indices)
        if len(view.components) == 1:
            pool = view.components[0]
            return describe_trusted(pool, pages, object_keys[0], pool.page_tokens)
        return concat([describe_trusted(pool, pages, keys, pool.page_tokens)
                       for pool, keys in zip(view.components, object_keys, strict=True)])

    # Both run the Mooncake call on this thread (``until_returned``): SGLang's I/O thread
    # waits for it anyway (:meth:`_let_go`), and a hand-off to the store's runner thread
    # cost 0.1-0.3 ms a call, a third of a one-page call. A put asks no exists query first:
    # Mooncake keeps an object that exists and sends nothing for it (SGLang answers True).
    def _get(self, desc):
        return self._let_go(self.store.get(desc, until_returned=True))

    def _put(self, desc):
        return self._let_go(self.store.put(desc, detect_exists=False, until_returned=True))

    @staticmethod
    def _let_go(result):
        """Answer SGLang only once Mooncake has released the host pages. A store call that
        timed out at its bound (its keys ``FAILED``) may still be in flight in Mooncake,
        writing into (get) or reading from (put) their memory, and SGLang frees or reuses
        the pages as soon as this call answers: so it is waited for here (Mooncake's own
        cap is 60 s). SGLang's storage calls run on its background I/O threads; its
        scheduler does not wait for them."""
        late = getattr(result, "late", None)
        if late is not None and not late.done():
            log.warning("kvmove SGLang backend: a store call timed out; waiting for "
                        "Mooncake to release the host pages before answering (pages read "
                        "as not stored)")
            try:
                late.result(timeout=_LET_GO_S)
            except Exception as e:  # still running after its cap: say so, loudly
                log.error("Mooncake still holds host pages after %.0f s (%s); answering now",
                          _LET_GO_S, e)
        return result

    def _staged_pages(self, objects: list[list[str]], host_indices, *, put: bool):
        """``(staged path, page numbers)`` of a put (``put=True``) or get of the KV pool's
        objects at ``host_indices`` where :attr:`staged` moves it (checked as
        :meth:`_describe` checks them), else None: it moves in place."""
        staged = self.staged  # once: a registration may replace it meanwhile
        if staged is None or not staged.staged(put=put):
            return None
        pages = self._pages(self._kv_view(), objects, host_indices)
        return (staged, pages) if staged.takes(objects[0], pages) else None

    def _kv_call(self, keys, host_indices, *, put: bool) -> list[kvmove.Status]:
        """The statuses of a put or get of the KV pool's pages ``keys`` at
        ``host_indices`` (objects component-major): staged where :attr:`staged` stages
        it, else in place."""
        objects = self.keys.kv_objects(keys)
        staged = self._staged_pages(objects, host_indices, put=put)
        if staged is not None:
            path, pages = staged
            return path.move(objects[0], pages, put=put)
        desc = self._describe(self._kv_view(), objects, host_indices)
        return self._put(desc) if put else self._get(desc)

    @staticmethod
    def _per_page(statuses, n: int, ok=(kvmove.Status.OK,)) -> list[bool]:
        """A page succeeds when every one of its objects did (objects component-major)."""
        if n and (statuses.count(ok[0]) if len(ok) == 1 else sum(map(statuses.count, ok))
                  ) == len(statuses):  # all good: passes in C
            return [True] * n
        good = np.fromiter((s in ok for s in statuses), dtype=bool, count=len(statuses))
        return good.reshape(-1, n).all(axis=0).tolist() if n else []

    def _exists(self, object_keys: list[list[str]]) -> list[bool]:
        """Per page, whether all its objects are stored."""
        n = len(object_keys[0])
        return self._per_page(self.store.exists([k for ks in object_keys for k in ks]), n,
                              ok=(True,))

    # -- the zero-copy interface (interface_v1) ---------------------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        """The number of leading pages of ``keys`` whose objects are all stored."""
        if not keys:
            return 0
        found = self._exists(self.keys.kv_objects(keys))
        return found.index(False) if False in found else len(found)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Read pages ``keys`` into the host pool at ``host_indices``, in place (the store
        writes the pool's rows; no copy). ``True`` only for a page whose objects were all
        read and had exactly the page's size. The rows of a page whose object is missing or
        of another size are untouched (Mooncake checks both before any transfer); a transfer
        that breaks mid-way (its holder died) may leave part of the object in that page's
        rows, as with SGLang's own backend."""
        if not keys:
            return []
        if not self.figures.enabled:
            return self._per_page(self._kv_call(keys, host_indices, put=False), len(keys))
        t0 = time.perf_counter()
        statuses = self._kv_call(keys, host_indices, put=False)
        self.figures.moved(statuses, len(keys), self.kv,
                           time.perf_counter() - t0, put=False)
        return self._per_page(statuses, len(keys))

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Store pages ``keys`` from the host pool at ``host_indices``; objects that exist
        are kept, not sent again (SGLang's behaviour). ``True`` for a page whose objects are
        all stored."""
        if not keys:
            return []
        if not self.figures.enabled:
            return self._per_page(self._kv_call(keys, host_indices, put=True), len(keys),
                                  ok=_DONE)
        t0 = time.perf_counter()
        statuses = self._kv_call(keys, host_indices, put=True)
        self.figures.moved(statuses, len(keys), self.kv,
                           time.perf_counter() - t0, put=True)
        return self._per_page(statuses, len(keys), ok=_DONE)

    def get_stats(self):
        """SGLang's storage metrics since it last asked (``--enable-storage-metrics``)."""
        return self.figures.take()

    # -- side pools (v2) ---------------------------------------------------------------------
    def _side(self, transfer) -> tuple[str, PoolView]:
        name = str(transfer.name)
        if name == str(PoolName.KV):
            return name, self._kv_view()
        view = self.side.get(name)
        if view is None:
            raise ValueError(f"side pool {name!r} is not registered with kvmove's SGLang "
                             f"backend (registered: {sorted(self.side)})")
        return name, view

    def _side_objects(self, name: str, keys) -> list[list[str]]:
        if name == str(PoolName.KV):
            return self.keys.kv_objects(keys)
        return [self.keys.side_objects(keys, name)]

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """The usable prefix over the KV pages and every side pool of ``pool_transfers``
        (``ALL_PAGES``: each page of the prefix; ``TRAILING_PAGES``: the last
        ``len(transfer.keys)`` pages of it)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name, _ = self._side(transfer)
            found = self._exists(self._side_objects(name, keys[:kv_pages]))
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = found.index(False) if False in found else kv_pages
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {n for n in range(1, kv_pages + 1)
                           if all(found[max(0, n - window):n])}
                boundary = max(allowed, default=0)
            else:
                raise ValueError(f"side pool {name!r}: hit policy {transfer.hit_policy} is not "
                                 f"served by kvmove's SGLang backend")
            if boundary:
                hits[transfer.name] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _batch_v2(self, transfers, *, put: bool) -> dict:
        """One store call for the objects of every transfer moved in place (the KV pool's
        pages through staging, where :attr:`staged` stages them, in a call of their own).
        Every transfer is checked before any moves."""
        parts, spans, staged = [], [], []
        for transfer in transfers:
            name, view = self._side(transfer)
            keys = list(transfer.keys or [])
            if not keys:
                spans.append((transfer.name, 0, 0))
                continue
            objects = self._side_objects(name, keys)
            if name == str(PoolName.KV):
                found = self._staged_pages(objects, transfer.host_indices, put=put)
                if found is not None:
                    spans.append((transfer.name, len(keys), -1 - len(staged)))
                    staged.append((found[0], objects[0], found[1]))
                    continue
            desc = self._describe(view, objects, transfer.host_indices)
            spans.append((transfer.name, len(keys), len(desc)))
            parts.append(desc)
        own = [path.move(objects, pages, put=put) for path, objects, pages in staged]
        statuses = []
        if parts:
            desc = concat(parts)
            statuses = self._put(desc) if put else self._get(desc)
        out, at = {}, 0
        ok = _DONE if put else (kvmove.Status.OK,)
        for name, n, count in spans:
            if count < 0:  # the staged call numbered -1 - count
                out[name] = self._per_page(own[-1 - count], n, ok=ok)
                continue
            out[name] = self._per_page(statuses[at:at + count], n, ok=ok)
            at += count
        return out

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        """Read each transfer's pages into its pool: ``{pool name: [bool per page]}``."""
        return self._batch_v2(transfers, put=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        """Store each transfer's pages from its pool: ``{pool name: [bool per page]}``."""
        return self._batch_v2(transfers, put=True)

    # -- the legacy interface: copy through a registered buffer -----------------------------
    def _legacy(self, keys: list[str], values: list[torch.Tensor] | None, *, put: bool):
        """Put ``values`` (flat pages, as SGLang's ``get_data_page`` gives them) under
        ``keys``, or get the pages into them, copying through one registered buffer. The
        objects are the v1 objects: a flat MHA page is its k half then its v half."""
        view = self._kv_view()
        sizes = view.page_bytes
        page = sum(sizes)
        for i, v in enumerate(values):
            if not isinstance(v, torch.Tensor) or v.numel() * v.element_size() != page:
                raise ValueError(f"values[{i}] must be a tensor of one page ({page} bytes), "
                                 f"got {type(v).__name__} "
                                 f"{getattr(v, 'shape', '')} {getattr(v, 'dtype', '')}")
        n = len(keys)
        with self._bounce_lock:
            bounce = self._bounce_of(n * page)
            flat = bounce.tensor[: n * page].view(n, page)
            if put:
                for i, v in enumerate(values):
                    flat[i].copy_(v.contiguous().view(-1).view(torch.uint8))
            base = flat.data_ptr()
            ptrs, lens, names, offset = [], [], [], 0
            for size, objects in zip(sizes, self.keys.kv_objects(keys), strict=True):
                ptrs += [[base + i * page + offset] for i in range(n)]
                lens += [[size]] * n
                names += objects
                offset += size
            desc = kvmove.Descriptors(names, ptrs, lens, regions=[(bounce.address,
                                                                   bounce.nbytes)])
            if put:
                return self._per_page(self._put(desc), n, ok=_DONE)
            ok = self._per_page(self._get(desc), n)
            for i, v in enumerate(values):
                if ok[i]:
                    v.view(-1).view(torch.uint8).copy_(flat[i])
            return ok

    def _bounce_of(self, nbytes: int) -> HostMemory:
        """The registered copy buffer, grown to at least ``nbytes`` (caller holds the lock)."""
        if self._bounce is None or self._bounce.nbytes < nbytes:
            if self._bounce is not None:
                self.store.unregister([(self._bounce.address, self._bounce.nbytes)])
                self._bounce.close()
            self._bounce = HostMemory(max(nbytes, 1 << 20), pin=False)
            self.store.register([(self._bounce.address, self._bounce.nbytes)])
        return self._bounce

    def get(self, key, target_location=None, target_sizes=None):
        """Read page ``key`` into the flat page tensor ``target_location``; it, or ``None``
        on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Read pages into the flat page tensors ``target_locations``: per key the tensor, or
        ``None`` where the page was not read."""
        keys = list(keys)
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one flat page tensor per key in "
                             "target_locations")
        ok = self._legacy(keys, list(target_locations), put=False)
        return [t if hit else None for t, hit in zip(target_locations, ok, strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        """Store the flat page tensor ``value`` under page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Store flat page tensors ``values`` under page ``keys``; ``True`` when all are
        stored."""
        keys = list(keys)
        if not keys:
            return False
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one flat page tensor per key in values")
        return all(self._legacy(keys, list(values), put=True))

    def exists(self, key) -> bool:
        """Whether page ``key``'s objects are all stored."""
        return self.batch_exists([key]) == 1

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister the pools and leave the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.staged is not None:
                self.staged.close()
        finally:
            self.store.close()
            if self._bounce is not None:
                self._bounce.close()

    def __repr__(self) -> str:
        pools = [self.kv.kind] if self.kv else []
        pools += [f"{name}" for name in self.side]
        return (f"KVMoveStorage(master {self.store.address}, prefix {self.keys.prefix!r}, "
                f"pools {pools})")
