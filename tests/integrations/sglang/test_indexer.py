"""The DSA indexer side pool through the v2 calls: what SGLang's own Mooncake backend stores
for a page's indexer rows, kvmove's backend reads back exact (and the reverse), the usable
prefix covers both pools, and an indexer pool kvmove does not serve is refused."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from tests.integrations.sglang.conftest import (
    indexer_pool,
    kvmove_backend,
    mla_pool,
    page_data,
    sglang_backend,
    storage_config,
)

PAGE = 4


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def indexer_page(pool, page):
    return pool.index_k_with_scale_buffer[page].numpy().tobytes()


@pytest.mark.parametrize("direction", ["sglang->kvmove", "kvmove->sglang"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_indexer_round_trip(layout, direction, master, model):
    make = {"sglang": sglang_backend, "kvmove": kvmove_backend}
    writer_kind, reader_kind = direction.split("->")
    writer = make[writer_kind](storage_config(mla=True, page_first=True, model=model))
    reader = make[reader_kind](storage_config(mla=True, page_first=True, model=model))
    try:
        kv_src = mla_pool(layout, page_size=PAGE, tokens=64, seed=1)
        kv_dst = mla_pool(layout, page_size=PAGE, tokens=64, seed=2)
        ix_src = indexer_pool(layout, page_size=PAGE, pages=17, seed=3)
        ix_dst = indexer_pool(layout, page_size=PAGE, pages=17, seed=4)
        untouched = indexer_page(ix_dst, 9)
        for backend, kv, ix in ((writer, kv_src, ix_src), (reader, kv_dst, ix_dst)):
            backend.register_mem_pool_host(kv)
            backend.register_mem_host_pool_v2(ix, PoolName.INDEXER)
        keys = ["d1", "d2", "d3"]
        assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
        # the indexer object of the last page is missing
        put = writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER,
                                                host_indices=indices([1, 2]), keys=keys[:2])])
        assert put == {PoolName.INDEXER: [True, True]}
        found = reader.batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
        assert found.kv_hit_pages == 2
        assert found.extra_pool_hit_pages[PoolName.INDEXER] == 2
        got = reader.batch_get_v2([PoolTransfer(name=PoolName.INDEXER,
                                                host_indices=indices([7, 8, 9]), keys=keys)])
        assert got == {PoolName.INDEXER: [True, True, False]}
        assert indexer_page(ix_dst, 7) == indexer_page(ix_src, 1)
        assert indexer_page(ix_dst, 8) == indexer_page(ix_src, 2)
        assert indexer_page(ix_dst, 9) == untouched
        assert reader.batch_get_v1(keys[:2], indices([7, 8])) == [True, True]
        assert page_data(kv_dst, 8) == page_data(kv_src, 2)
    finally:
        writer.close()
        reader.close()


def test_a_layer_first_indexer_pool_is_refused(master, model):
    backend = kvmove_backend(storage_config(mla=True, page_first=False, model=model))
    try:
        backend.register_mem_pool_host(mla_pool("layer_first", page_size=PAGE, tokens=64,
                                                seed=1))
        pool = indexer_pool("page_first", page_size=PAGE, pages=17, seed=3)
        pool.layout = "layer_first"
        with pytest.raises(ValueError, match="DSA indexer host pools in layout 'layer_first'"):
            backend.register_mem_host_pool_v2(pool, PoolName.INDEXER)
        with pytest.raises(ValueError, match="indexer side pool only, not 'mamba'"):
            backend.register_mem_host_pool_v2(pool, PoolName.MAMBA)
    finally:
        backend.close()
