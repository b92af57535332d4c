"""Tenant-safe keys and load errors through kvmove's SGLang backend, built by SGLang's own
factory, against a real Mooncake master: backends of two tenants (``extra_config["tenant"]``
or ``KVMOVE_TENANT``) with the same model and page hashes never read each other's pages, nor
does a backend with no tenant or SGLang's own; SGLang's own page hashes already differ per
``extra_key`` / ``cache_salt``; and one failed object of a hybrid page (MLA KV + DSA indexer,
or MHA k + v) stops SGLang's own prefix count at that page. Asserts bytes in host pools."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from tests.integrations.sglang.conftest import (
    indexer_pool,
    kvmove_backend,
    mha_pool,
    mla_pool,
    page_data,
    sglang_backend,
    storage_config,
)

PAGE = 4


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def backend(model, mla=True, layout="page_first", **extra):
    return kvmove_backend(storage_config(mla=mla, page_first=layout != "layer_first",
                                         model=model, extra=extra))


@pytest.mark.parametrize("mla,layout", [(True, "page_first"), (True, "layer_first"),
                                        (False, "page_first")])
def test_two_tenants_with_the_same_pages_never_read_each_others(master, model, mla, layout,
                                                               monkeypatch):
    """``layer_first`` MLA pages may move through the staged path: the same keys."""
    make = mla_pool if mla else mha_pool
    keys = ["h1", "h2", "h3"]
    monkeypatch.setenv("KVMOVE_TENANT", "team-a")
    writer = backend(model, mla, layout)  # the tenant from the environment
    src = make(layout, page_size=PAGE, tokens=64, seed=1)
    writer.register_mem_pool_host(src)
    assert writer.keys.tenant == "team-a"
    assert all(k.startswith("kvmt-t.team-a/") for c in writer.keys.kv_objects(keys) for k in c)
    assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
    monkeypatch.delenv("KVMOVE_TENANT")
    readers = {"team-b": backend(model, mla, layout, tenant="team-b"),
               "none": backend(model, mla, layout),
               "team-a": backend(model, mla, layout, tenant=" team-a ")}
    own = sglang_backend(storage_config(mla=mla, page_first=layout != "layer_first",
                                        model=model))
    try:
        assert own.batch_exists(keys) == 0  # SGLang's own backend: no tenant
        for name, reader in readers.items():
            dst = make(layout, page_size=PAGE, tokens=64, seed=2)
            reader.register_mem_pool_host(dst)
            before = [page_data(dst, p) for p in (5, 6, 7)]
            hit = name == "team-a"
            assert reader.batch_exists(keys) == (3 if hit else 0), name
            assert reader.batch_get_v1(keys, indices([5, 6, 7])) == [hit] * 3, name
            want = [page_data(src, p) for p in (1, 2, 3)] if hit else before
            assert [page_data(dst, p) for p in (5, 6, 7)] == want, name
    finally:
        for b in (writer, *readers.values()):
            b.close()


def test_a_tenant_that_is_not_a_string_is_refused(master, model):
    with pytest.raises(ValueError, match="tenant must be a string"):
        backend(model, tenant=["a"])


def test_sglangs_own_hashes_differ_per_extra_key_and_salt(master, model):
    """What SGLang does itself (checked): its storage hashes are seeded with the request's
    ``extra_key`` and ``cache_salt``, so the same tokens name other objects; kvmove's
    backend, with no tenant of its own, keeps those keys and so that isolation."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = array("l", range(3 * PAGE))

    def hashes(**ns):
        return get_storage_hash_str(RadixKey(tokens, **ns), page_size=PAGE)

    plain, lora, salted = hashes(), hashes(extra_key="lora-a"), hashes(cache_salt="alice")
    assert len({plain[0], lora[0], salted[0]}) == 3 and plain == hashes()
    writer, reader = backend(model), backend(model)
    try:
        src = mla_pool("page_first", page_size=PAGE, tokens=64, seed=3)
        dst = mla_pool("page_first", page_size=PAGE, tokens=64, seed=4)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        assert writer.batch_set_v1(lora, indices([1, 2, 3])) == [True] * 3
        assert reader.batch_exists(plain) == 0 and reader.batch_exists(salted) == 0
        assert reader.batch_exists(hashes(extra_key="lora-b")) == 0
        assert reader.batch_get_v1(lora, indices([5, 6, 7])) == [True] * 3
        assert [page_data(dst, p) for p in (5, 6, 7)] == [page_data(src, p) for p in (1, 2, 3)]
    finally:
        writer.close()
        reader.close()


def sglang_prefix_count(storage, keys, host_indices, side: bool) -> int:
    """The pages SGLang's cache controller counts as read (its own
    ``_page_transfer_kv_batch``: the KV pages, then the KV-derived side pools, clamped to
    the fewest), run on ``storage``."""
    from sglang.srt.managers.cache_controller import HiCacheController

    ctl = SimpleNamespace(storage_backend=storage)
    ctl.page_get_func = lambda op, h, i, e: HiCacheController._page_get_zero_copy(ctl, op, h,
                                                                                 i, e)
    side_pools = [PoolTransfer(name=PoolName.INDEXER)] if side else []
    return HiCacheController._page_transfer_kv_batch(
        ctl, SimpleNamespace(request_id="r"), keys, host_indices,
        HiCacheStorageExtraInfo(prefix_keys=None), side_pools)


@pytest.mark.parametrize("failed", ["kv", "indexer"])
def test_one_failed_object_of_a_hybrid_page_stops_the_prefix_there(master, model, failed):
    """MLA KV + DSA indexer: the object of page 1 (of 0, 1, 2) of one pool is gone. The
    backend fails page 1 of that pool; SGLang's exists and get counts stop at 1 page, and
    page 0's bytes are in both pools."""
    keys = ["x0", "x1", "x2"]
    writer, reader = backend(model, tenant="hybrid"), backend(model, tenant="hybrid")
    try:
        kv_src = mla_pool("page_first", page_size=PAGE, tokens=64, seed=5)
        kv_dst = mla_pool("page_first", page_size=PAGE, tokens=64, seed=6)
        ix_src = indexer_pool("page_first", page_size=PAGE, pages=17, seed=7)
        ix_dst = indexer_pool("page_first", page_size=PAGE, pages=17, seed=8)
        for b, kv, ix in ((writer, kv_src, ix_src), (reader, kv_dst, ix_dst)):
            b.register_mem_pool_host(kv)
            b.register_mem_host_pool_v2(ix, PoolName.INDEXER)
        assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
        assert writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER,
                                                 host_indices=indices([1, 2, 3]), keys=keys)]) \
            == {PoolName.INDEXER: [True] * 3}
        gone = (writer.keys.kv_objects(["x1"])[0] if failed == "kv"
                else writer.keys.side_objects(["x1"], str(PoolName.INDEXER)))
        writer.store.remove(gone)
        found = reader.batch_exists_v2(keys, [PoolTransfer(
            name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
        assert found.kv_hit_pages == 1 and found.restorable_prefix_pages == [1]
        assert found.extra_pool_hit_pages[PoolName.INDEXER] == 1
        assert sglang_prefix_count(reader, keys, indices([7, 8, 9]), side=True) == 1
        assert page_data(kv_dst, 7) == page_data(kv_src, 1)
        assert ix_dst.index_k_with_scale_buffer[7].numpy().tobytes() == \
            ix_src.index_k_with_scale_buffer[1].numpy().tobytes()
    finally:
        writer.close()
        reader.close()


def test_one_failed_half_of_an_mha_page_fails_that_page(master, model):
    """MHA: a page is a k and a v object. Its v gone, the page fails, the pages before it
    are read, and SGLang's prefix count stops before it."""
    keys = ["m0", "m1", "m2"]
    writer, reader = backend(model, mla=False), backend(model, mla=False)
    try:
        src = mha_pool("page_first", page_size=PAGE, tokens=64, seed=9)
        dst = mha_pool("page_first", page_size=PAGE, tokens=64, seed=10)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        assert writer.batch_set_v1(keys, indices([1, 2, 3])) == [True] * 3
        writer.store.remove([writer.keys.kv_objects(["m1"])[1][0]])  # page 1's v
        assert reader.batch_exists(keys) == 1
        assert sglang_prefix_count(reader, keys, indices([7, 8, 9]), side=False) == 1
        assert page_data(dst, 7) == page_data(src, 1)
        assert reader.batch_get_v1(keys, indices([7, 8, 9])) == [True, False, True]
        assert page_data(dst, 9) == page_data(src, 3)
    finally:
        writer.close()
        reader.close()
