"""kvmove's SGLang backend (created through SGLang's "dynamic" factory) and SGLang's own
Mooncake backend share objects: what one writes from a host pool, the other reads into
another host pool with every row exact, for MLA and MHA pools in each layout both serve."""

from __future__ import annotations

import pytest
import torch

import kvmove
from tests.integrations.sglang.conftest import (
    kvmove_backend,
    mha_pool,
    mla_pool,
    page_data,
    sglang_backend,
    storage_config,
)
from tests.support.tenants import multi_tenant_store

PAGE = 4
TOKENS = 64  # 16 pages
CASES = [("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct"),
         ("mha", "page_first"), ("mha", "page_first_direct")]


def make_pool(kind, layout, seed):
    build = mla_pool if kind == "mla" else mha_pool
    return build(layout, page_size=PAGE, tokens=TOKENS, seed=seed)


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def backends(direction, config_of):
    make = {"sglang": sglang_backend, "kvmove": kvmove_backend}
    writer, reader = direction.split("->")
    return make[writer](config_of()), make[reader](config_of())


@pytest.mark.parametrize("direction", ["sglang->kvmove", "kvmove->sglang"])
@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_one_writes_the_other_reads_rows_exact(kind, layout, direction, master, model):
    def config():
        return storage_config(mla=kind == "mla", page_first=layout != "layer_first",
                              model=model)

    writer, reader = backends(direction, config)
    try:
        src, dst = make_pool(kind, layout, 1), make_pool(kind, layout, 2)
        before = dst.kv_buffer.clone()
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        keys = ["h1", "h3", "h4"]
        assert writer.batch_set_v1(keys, indices([1, 3, 4])) == [True] * 3
        assert reader.batch_exists([*keys, "nothing"]) == 3
        assert reader.batch_get_v1(keys, indices([0, 5, 2])) == [True] * 3
        for d, s in ((0, 1), (5, 3), (2, 4)):
            assert page_data(dst, d) == page_data(src, s)
        for page in (1, 3, 4, 6, 7):  # pages not read into are untouched
            assert page_data(dst, page) == page_bytes(before, kind, layout, page)
    finally:
        writer.close()
        reader.close()


def test_keys_are_sglangs(master, model):
    """The raw object keys: '<model with - for />_<hash>__k' (MLA), '_<tp rank>_k/_v' (MHA),
    with the extra backend tag in front."""
    kv = kvmove_backend(storage_config(mla=True, page_first=True, model=model,
                                       extra={"extra_backend_tag": "tag"}))
    mha = kvmove_backend(storage_config(mla=False, page_first=True, model=model, tp_rank=3))
    probe = kvmove.MooncakeStore.from_env()
    try:
        kv.register_mem_pool_host(make_pool("mla", "page_first", 1))
        mha.register_mem_pool_host(make_pool("mha", "page_first", 1))
        assert kv.batch_set_v1(["abc"], indices([2])) == [True]
        assert mha.batch_set_v1(["abc"], indices([2])) == [True]
        name = model.replace("/", "-")
        assert probe.exists([f"tag_{name}_abc__k", f"{name}_abc_3_k", f"{name}_abc_3_v",
                             f"{name}_abc__k"]) == [True, True, True, False]
    finally:
        kv.close()
        mha.close()
        probe.close()


@pytest.mark.parametrize("kind", ["mla", "mha"])
def test_a_miss_among_hits(kind, master, model):
    layout = "page_first"
    config = storage_config(mla=kind == "mla", page_first=True, model=model)
    writer, reader = sglang_backend(config), kvmove_backend(
        storage_config(mla=kind == "mla", page_first=True, model=model))
    try:
        src, dst = make_pool(kind, layout, 1), make_pool(kind, layout, 2)
        before = dst.kv_buffer.clone()
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        assert writer.batch_set_v1(["a", "c"], indices([1, 2])) == [True, True]
        assert reader.batch_exists(["a", "b", "c"]) == 1
        assert reader.batch_get_v1(["a", "b", "c"], indices([5, 6, 7])) == [True, False, True]
        assert page_data(dst, 5) == page_data(src, 1)
        assert page_data(dst, 7) == page_data(src, 2)
        assert page_data(dst, 6) == page_bytes(before, kind, layout, 6)  # untouched
    finally:
        writer.close()
        reader.close()



def test_a_tenants_pages_are_its_own(tmp_path, model):
    """On a master that keeps tenants apart, pages kvmove's backend stores with the extra
    config's ``tenant_id`` (padded, as SGLang strips it) live in that tenant's key space: a
    client of the tenant sees them, SGLang's own backend of the tenant reads them row-exact,
    and the default tenant (a client, or a backend that names no tenant) does not see them."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    default = multi_tenant_store(tmp_path)
    opened = []
    try:
        def extra(**more):
            return {"master_server_address": default.address, "protocol": "tcp",
                    "local_hostname": "127.0.0.1", "global_segment_size": 64 << 20, **more}

        def config(**more):
            return storage_config(mla=True, page_first=True, model=model, extra=extra(**more))

        writer = kvmove_backend(config(tenant_id=" team-a "))
        opened.append(writer.store)
        assert writer.store.config.tenant_id == "team-a"
        src = make_pool("mla", "page_first", 1)
        writer.register_mem_pool_host(src)
        assert writer.batch_set_v1(["t1", "t2"], indices([1, 2])) == [True, True]
        keys = [f"{model.replace('/', '-')}_{h}__k" for h in ("t1", "t2")]

        team = kvmove.MooncakeStore(kvmove.StoreConfig(
            master_address=default.address, tenant_id="team-a", global_segment_size=0))
        opened.append(team)
        assert team.exists(keys) == [True, True]
        assert default.exists(keys) == [False, False]  # the default tenant's key space

        theirs = MooncakeStore(config(tenant_id="team-a"))  # SGLang's own, same tenant
        opened.append(theirs.store)
        dst = make_pool("mla", "page_first", 2)
        theirs.register_mem_pool_host(dst)
        assert theirs.batch_get_v1(["t1", "t2"], indices([5, 6])) == [True, True]
        assert [page_data(dst, p) for p in (5, 6)] == [page_data(src, p) for p in (1, 2)]

        other = kvmove_backend(config())  # no tenant_id: the default tenant
        opened.append(other.store)
        assert other.store.config.tenant_id == "default"
        other.register_mem_pool_host(make_pool("mla", "page_first", 3))
        assert other.batch_exists(["t1", "t2"]) == 0
    finally:
        for store in reversed(opened):  # while the master is there
            store.close()
        default.close()


def page_bytes(kv_buffer, kind, layout, page):
    """The bytes of ``page`` in a copy of a pool's kv_buffer (as SGLang's get_data_page)."""
    if kind == "mha":  # SGLang's MHA page is its k half, then its v half
        return b"".join(page_bytes(kv_buffer[i], "mla", layout, page) for i in range(2))
    t = kv_buffer
    if layout == "layer_first":
        t = t[:, page * PAGE:(page + 1) * PAGE]
    elif layout == "page_first":
        t = t[page * PAGE:(page + 1) * PAGE]
    else:
        t = t[page]
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_a_wrong_sized_object_is_a_miss(master, model):
    """A page of another size under the same key (another page size) is never read."""
    small = sglang_backend(storage_config(mla=True, page_first=True, model=model))
    reader = kvmove_backend(storage_config(mla=True, page_first=True, model=model))
    try:
        src = mla_pool("page_first", page_size=2, tokens=TOKENS, seed=1)
        small.register_mem_pool_host(src)
        assert small.batch_set_v1(["x"], torch.arange(2, 4)) == [True]
        dst = make_pool("mla", "page_first", 2)
        before = dst.kv_buffer.clone()
        reader.register_mem_pool_host(dst)
        assert reader.batch_get_v1(["x"], indices([3])) == [False]
        assert torch.equal(dst.kv_buffer.view(torch.uint8), before.view(torch.uint8))
    finally:
        small.close()
        reader.close()


def test_set_skips_pages_that_exist(master, model):
    backend = kvmove_backend(storage_config(mla=True, page_first=True, model=model))
    try:
        pool = make_pool("mla", "page_first", 1)
        backend.register_mem_pool_host(pool)
        first = page_data(pool, 1)
        assert backend.batch_set_v1(["p"], indices([1])) == [True]
        pool.kv_buffer[PAGE:2 * PAGE] = 0  # the page changes; the stored object must not
        assert backend.batch_set_v1(["p"], indices([1])) == [True]
        assert backend.batch_get_v1(["p"], indices([9])) == [True]
        assert page_data(pool, 9) == first
    finally:
        backend.close()


@pytest.mark.parametrize(("kind", "layout"), [("mla", "page_first"), ("mha", "page_first")])
def test_legacy_calls_store_the_v1_objects(kind, layout, master, model):
    """batch_set/batch_get with flat pages (SGLang's generic path) copy through kvmove's
    registered buffer and store the same objects as batch_set_v1."""
    config = storage_config(mla=kind == "mla", page_first=True, model=model)
    legacy, zero_copy = kvmove_backend(config), sglang_backend(
        storage_config(mla=kind == "mla", page_first=True, model=model))
    try:
        src, dst = make_pool(kind, layout, 1), make_pool(kind, layout, 2)
        legacy.register_mem_pool_host(src)
        zero_copy.register_mem_pool_host(dst)
        pages = [src.get_data_page(p * PAGE) for p in (2, 3)]
        assert legacy.batch_set(["l0", "l1"], pages) is True
        assert legacy.exists("l0") and not legacy.exists("l9")
        assert zero_copy.batch_get_v1(["l0", "l1"], indices([4, 5])) == [True, True]
        assert page_data(dst, 4) == page_data(src, 2)
        assert page_data(dst, 5) == page_data(src, 3)
        targets = [src.get_dummy_flat_data_page() for _ in range(3)]
        got = legacy.batch_get(["l1", "missing", "l0"], targets)
        assert got[1] is None
        assert got[0].view(torch.uint8).numpy().tobytes() == page_data(src, 3)
        assert legacy.get("l0", src.get_dummy_flat_data_page()) is not None
        assert legacy.set("l2", src.get_data_page(7 * PAGE)) is True
    finally:
        legacy.close()
        zero_copy.close()


@pytest.mark.parametrize(("kind", "layout", "message"), [
    ("mha", "layer_first", "MHA host pools in layout 'layer_first'"),
])
def test_unsupported_combinations_raise_at_registration(kind, layout, message, master, model):
    backend = kvmove_backend(storage_config(mla=kind == "mla", page_first=False, model=model))
    try:
        with pytest.raises(ValueError, match=message):
            backend.register_mem_pool_host(make_pool(kind, layout, 1))
    finally:
        backend.close()
