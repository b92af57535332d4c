"""Tenant-safe keys through ``KVMover``: two tenants of one master, same geometry, same
prefix and same engine keys, never read each other's objects; the default mover (no tenant)
reads neither; ``KVMOVE_TENANT`` and ``tenant=""`` pick the tenant; raw keys with a tenant
keep other systems' keys apart too. Every check is on the bytes in the KV rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from tests.support.caches import ROW_BYTES, make_layers, snapshot

PAGE = 4
SRC = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
DST = torch.tensor([[8, 9, 10, 11], [12, 13, 14, 15]])


def cache(row_bytes: int, seed: int) -> kvmove.KVCache:
    """A hybrid cache: the KV rows and a DSA-like indexer beside them."""
    return kvmove.KVCache({"kv": make_layers(3, 32, row_bytes, torch.uint8, seed=seed),
                           "indexer": make_layers(3, 32, 132, torch.uint8, seed=seed + 1)})


def page_bytes(kv: kvmove.KVCache, pages: torch.Tensor) -> list[bytes]:
    return [b"".join(kv.layer(n, i)[p].numpy().tobytes() for n in kv.buffer_names
                     for i in range(kv.num_layers(n))) for p in pages]


def mover(kv, store, **kw) -> kvmove.KVMover:
    return kvmove.KVMover(kv, store, page_tokens=PAGE, staging_slots=4, path="staged",
                          key_prefix=kw.pop("key_prefix", "tenants"), **kw)


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row_bytes=st.sampled_from(ROW_BYTES))
def test_two_tenants_with_the_same_keys_never_read_each_others_objects(store, keyspace,
                                                                       row_bytes):
    keys = keyspace(2)
    src = cache(row_bytes, seed=1)
    want = page_bytes(src, SRC)
    a = mover(src, store, tenant="team-a")
    try:
        assert a.evict(keys, SRC).wait(timeout=30) == [kvmove.Status.OK] * 2
    finally:
        a.close()
    for tenant in ("team-b", "", "team-a "):  # another tenant, none, the same one (stripped)
        dst = cache(row_bytes, seed=7)
        before = snapshot(dst)
        m = mover(dst, store, tenant=tenant)
        try:
            statuses = m.prefetch(keys, DST).wait(timeout=30)
        finally:
            m.close()
        if tenant.strip() == "team-a":
            assert statuses == [kvmove.Status.OK] * 2
            assert page_bytes(dst, DST) == want
        else:
            assert statuses == [kvmove.Status.MISS] * 2, tenant
            after = snapshot(dst)
            assert all(torch.equal(x, y) for n in before for x, y in zip(before[n], after[n],
                                                                         strict=True))


def test_kvmove_tenant_names_the_tenant_and_an_empty_argument_turns_it_off(store, keyspace,
                                                                            monkeypatch):
    keys = keyspace(2)
    src = cache(576, seed=2)
    monkeypatch.setenv("KVMOVE_TENANT", "  env-tenant ")
    a = mover(src, store)
    try:
        assert a.keyspace.tenant == "env-tenant"
        assert a.keyspace.store_keys(keys)[0].endswith(f"/t.env-tenant:{keys[0]}")
        assert a.evict(keys, SRC).wait(timeout=30) == [kvmove.Status.OK] * 2
    finally:
        a.close()
    for tenant, found in ((None, kvmove.Status.OK), ("", kvmove.Status.MISS),
                          ("env-tenant", kvmove.Status.OK)):
        dst = cache(576, seed=8)
        m = mover(dst, store, tenant=tenant)
        try:
            assert m.prefetch(keys, DST).wait(timeout=30) == [found] * 2, tenant
        finally:
            m.close()
        if found is kvmove.Status.OK:
            assert page_bytes(dst, DST) == page_bytes(src, SRC)


def test_raw_keys_with_a_tenant_are_apart_from_the_same_raw_keys_without(store, keyspace,
                                                                          monkeypatch):
    """Raw keys (another system's) take the tenant argument only: ``KVMOVE_TENANT`` is the
    integration's to place."""
    monkeypatch.setenv("KVMOVE_TENANT", "ignored-here")
    keys = keyspace(2, tag="vllm-like@")
    src = cache(656, seed=3)
    plain = mover(src, store, key_prefix="", raw_keys=True)
    salted = mover(src, store, key_prefix="", raw_keys=True, tenant="a b/c")  # hashed name
    try:
        assert plain.keyspace.store_keys(keys) == keys
        head = salted.keyspace.store_keys(keys)[0][: -len(keys[0])]
        assert head.startswith("kvmt-h.") and head.endswith("/") and " " not in head
        assert salted.evict(keys, SRC).wait(timeout=30) == [kvmove.Status.OK] * 2
        assert plain.prefetch(keys, DST).wait(timeout=30) == [kvmove.Status.MISS] * 2
        assert salted.prefetch(keys, DST).wait(timeout=30) == [kvmove.Status.OK] * 2
        assert page_bytes(src, DST) == page_bytes(src, SRC)
    finally:
        plain.close()
        salted.close()


@pytest.mark.parametrize("tenant", [7, b"team", ["a"]])
def test_a_tenant_that_is_not_a_string_is_refused_before_anything_is_built(store, tenant):
    with pytest.raises(ValueError, match="tenant must be a str or None"):
        mover(cache(4, seed=0), store, tenant=tenant)
