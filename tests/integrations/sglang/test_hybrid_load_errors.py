"""One failed object of a hybrid (KV + DSA indexer) request, as SGLang's own cache controller
sees kvmove's answers.

A request of ``N`` pages is stored as an MLA KV object and a DSA indexer object per page;
then ONE object of page ``k`` fails: the KV object or the indexer object, removed from the
store (a miss every query sees) or replaced by an object of another size (present to the
query, failed on the get). SGLang's real code consumes the backend's answers here (no
re-implementation of its arithmetic):

- the hit query, ``HybridCacheController._storage_hit_query``
  (``mem_cache/hybrid_cache/hybrid_cache_controller.py``), which calls ``batch_exists_v2``
  with the indexer as a KV-derived side pool and keeps ``kv_hit_pages`` pages;
- the prefetch read, ``HybridCacheController._page_transfer_with_stable_layout`` (the body of
  its ``_page_transfer``): ``HiCacheController._page_transfer`` /
  ``_page_transfer_kv_batch`` (``managers/cache_controller.py``) reads the KV pages with
  ``batch_get_v1`` (``_page_get_zero_copy``: the leading run of ``True``) and the indexer
  pages with ``batch_get_v2`` (``count_pool_hits``: the leading run per pool), and keeps the
  smallest of those counts.

Either way the usable prefix SGLang takes is exactly pages ``0 .. k-1`` in every pool, their
bytes exact in both pools; the failed object's rows are untouched, and no other page's
rows hold a wrong byte (each is its stored page or what was there before).
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str

from tests.integrations.sglang.conftest import (
    indexer_pool,
    kvmove_backend,
    mla_pool,
    page_data,
    storage_config,
)

PAGE = 4
N = 6  # pages of the request
SRC = list(range(1, 1 + N))  # the writer's host pages
DST = list(range(8, 8 + N))  # where the reader's controller prefetches them


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def indexer_page(pool, page) -> bytes:
    return pool.index_k_with_scale_buffer[page].numpy().tobytes()


def controller(backend) -> HybridCacheController:
    """SGLang's hybrid cache controller as far as its hit query and prefetch read use it:
    kvmove's backend with ``interface_v1`` (zero-copy KV reads, ``_page_get_zero_copy``,
    as ``HiCacheController.__init__`` picks them), one page size, the queue its read posts
    progress to. Its threads, device pools and TP collectives are not needed on a CPU."""
    ctrl = object.__new__(HybridCacheController)
    ctrl.storage_backend = backend
    ctrl.page_size = PAGE
    ctrl.page_get_func = ctrl._page_get_zero_copy
    ctrl.prefetch_sync_queue = queue.Queue()
    return ctrl


def prefetch_operation(tokens: list[int], *, assume_stored: bool) -> PrefetchOperation:
    """A DSA request's prefetch: the indexer rides on the KV pool's indices (SGLang's
    ``SidecarPoolSpec(INDEXER, indices_from_pool=KV)``, hybrid_pool_assembler.py)."""
    return PrefetchOperation(
        SimpleNamespace(rid="hybrid"), tokens, assume_stored=assume_stored,
        pool_transfers=[PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
                                     hit_policy=PoolHitPolicy.ALL_PAGES)])


def read(ctrl, op, target_pages) -> int:
    """The controller's hit query then its prefetch read into ``target_pages``, as its
    prefetch thread sequences them (query, host_indices of the hit, KV-derived transfers
    resolved, read): the pages it completed."""
    hashes, hit_tokens = ctrl._storage_hit_query(op)
    pages = hit_tokens // PAGE
    op.hash_value = hashes[:pages]
    op.host_indices = indices(target_pages[:pages])
    ctrl._resolve_sidecar_kv_derived_pool_transfers(op)
    ctrl._page_transfer_with_stable_layout(op)
    acks = []
    while not ctrl.prefetch_sync_queue.empty():
        acks.append(ctrl.prefetch_sync_queue.get_nowait())
    done = [a.completed_tokens for a in acks if getattr(a, "completed_tokens", 0)]
    return (max(done) if done else 0) // PAGE


# Every failed pool with every way of failing, each KV layout and path twice (a covering
# set, not the whole product: each case starts two backends on a master).
@pytest.mark.parametrize("failed,how,kv_layout,path", [
    ("kv", "removed", "page_first", "auto"), ("indexer", "wrong_size", "page_first", "auto"),
    ("kv", "wrong_size", "layer_first", "in_place"),
    ("indexer", "removed", "layer_first", "in_place"),
    ("indexer", "wrong_size", "layer_first", "staged"),
    ("kv", "removed", "layer_first", "staged")])
def test_one_failed_object_ends_the_usable_prefix_in_every_pool(failed, how, kv_layout, path,
                                                                 master, model):
    config = dict(mla=True, page_first=kv_layout != "layer_first", model=model,
                  extra={"kvmove_path": path})
    writer, reader = kvmove_backend(storage_config(**config)), \
        kvmove_backend(storage_config(**config))
    try:
        kv_src = mla_pool(kv_layout, page_size=PAGE, tokens=64, seed=21)
        kv_dst = mla_pool(kv_layout, page_size=PAGE, tokens=64, seed=22)
        ix_src = indexer_pool("page_first", page_size=PAGE, pages=17, seed=23)
        ix_dst = indexer_pool("page_first", page_size=PAGE, pages=17, seed=24)
        for backend, kv, ix in ((writer, kv_src, ix_src), (reader, kv_dst, ix_dst)):
            backend.register_mem_pool_host(kv)
            backend.register_mem_host_pool_v2(ix, PoolName.INDEXER)
        tokens = list(range(1000, 1000 + N * PAGE))
        keys = get_storage_hash_str(tokens, page_size=PAGE)  # SGLang's page keys
        assert len(keys) == N
        assert writer.batch_set_v1(keys, indices(SRC)) == [True] * N
        assert writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                                 host_indices=indices(SRC))]) \
            == {PoolName.INDEXER: [True] * N}

        k = 2  # the page whose object fails
        key = (reader.keys.kv_objects([keys[k]])[0][0] if failed == "kv"
               else reader.keys.side_objects([keys[k]], str(PoolName.INDEXER))[0])
        reader.store.remove([key], force=True)
        if how == "wrong_size":  # present to the query, failed on the get
            assert reader.store.raw_client.put(key, bytes(16)) == 0
        kv_before = {p: page_data(kv_dst, p) for p in range(16)}
        ix_before = {p: indexer_page(ix_dst, p) for p in range(17)}

        # The backend's own answers, pool by pool (the per-page bools SGLang counts).
        found = reader.batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.INDEXER, indices_from_pool=PoolName.KV,
            hit_policy=PoolHitPolicy.ALL_PAGES)])
        want_hit = k if how == "removed" else N
        assert found.kv_hit_pages == want_hit
        assert max(found.restorable_prefix_pages or [0]) == want_hit
        # The pages after k, read on purpose into pages SGLang's read below does not use.
        spare = [p for p in range(15) if p not in DST][:N]
        kv_got = reader.batch_get_v1(keys, indices(spare))
        ix_got = reader.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                                   host_indices=indices(spare))])
        assert kv_got == [not (failed == "kv" and i == k) for i in range(N)]
        assert ix_got == {PoolName.INDEXER: [not (failed == "indexer" and i == k)
                                             for i in range(N)]}
        assert min(count_pool_hits({PoolName.KV: kv_got, **ix_got}).values()) == k
        failed_rows = page_data(kv_dst, spare[k]) if failed == "kv" \
            else indexer_page(ix_dst, spare[k])
        assert failed_rows == (kv_before if failed == "kv" else ix_before)[spare[k]]
        kv_before = {p: page_data(kv_dst, p) for p in range(16)}
        ix_before = {p: indexer_page(ix_dst, p) for p in range(17)}

        # What SGLang's controller takes: its hit query, then its read (queried, and
        # assuming the span stored, as SGLang does after a hit on a suffix of it).
        for assume_stored in (False, True):
            got = read(controller(reader), prefetch_operation(tokens,
                                                              assume_stored=assume_stored),
                       DST)
            assert got == k, (assume_stored, got)
            for i, (s, d) in enumerate(zip(SRC, DST, strict=True)):
                kv_now, ix_now = page_data(kv_dst, d), indexer_page(ix_dst, d)
                if i < k:  # usable: exact in both pools
                    assert kv_now == page_data(kv_src, s)
                    assert ix_now == indexer_page(ix_src, s)
                    continue
                # not counted: its stored page or what was there, never another byte
                assert kv_now in (page_data(kv_src, s), kv_before[d])
                assert ix_now in (indexer_page(ix_src, s), ix_before[d])
                if i == k:  # the failed object's rows are untouched
                    assert (kv_now == kv_before[d]) if failed == "kv" \
                        else (ix_now == ix_before[d])
            for p in range(16):
                if p not in DST:
                    assert page_data(kv_dst, p) == kv_before[p]
            for p in range(17):
                if p not in DST:
                    assert indexer_page(ix_dst, p) == ix_before[p]
    finally:
        writer.close()
        reader.close()
