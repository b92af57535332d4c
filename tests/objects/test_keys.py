"""Store keys: the namespace changes whenever the object format would (geometry, page size,
checksum, layout), stays put when it would not, and raw keys are used as given."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvmove
from kvmove.objects.keys import KeySpace, RawKeys, geometry_fingerprint, tenant_head, tenant_tag


def cache(rows=656, layers=2, dtype=torch.uint8, slots=32, names=("kv",)):
    return kvmove.KVCache({n: torch.zeros(layers, slots, rows // dtype.itemsize, dtype=dtype)
                           for n in names})


def test_store_keys_carry_the_namespace_and_the_prefix():
    space = KeySpace(cache(), 16, "model-a_tp0.v1")
    assert space.namespace == f"kvm-{space.fingerprint}-model-a_tp0.v1"
    assert space.store_keys(["p1", "p2"]) == [f"{space.namespace}:p1", f"{space.namespace}:p2"]
    assert KeySpace(cache(), 16).namespace == f"kvm-{space.fingerprint}"


@pytest.mark.parametrize("change", [
    dict(kv=cache(rows=132)), dict(kv=cache(layers=3)), dict(kv=cache(dtype=torch.float32)),
    dict(kv=cache(names=("kv", "indexer"))), dict(page_tokens=64), dict(checksum=True),
    dict(layout="page_first"),
])
def test_the_fingerprint_changes_with_the_object_format(change):
    base = dict(kv=cache(), page_tokens=16, checksum=False, layout="layer_first")
    assert geometry_fingerprint(**base) != geometry_fingerprint(**(base | change))


def test_the_fingerprint_ignores_what_does_not_change_objects():
    # The number of KV slots and the memory the cache lives in do not change an object.
    assert geometry_fingerprint(cache(slots=32), 16) == geometry_fingerprint(cache(slots=64), 16)
    fp = geometry_fingerprint(cache(), 16)
    assert len(fp) == 12 and int(fp, 16) >= 0


@pytest.mark.parametrize("prefix", ["a b", "a:b", "a/b", "é", 7, "ok\n", "ok\r\n"])
def test_a_prefix_outside_the_allowed_characters_is_refused(prefix):
    with pytest.raises(ValueError, match="key_prefix"):
        KeySpace(cache(), 16, prefix)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="layout must be one of"):
        KeySpace(cache(), 16, layout="token_first")


def test_raw_keys_are_used_as_given():
    keys = ["m@tp_rank:0@group:0@00ff", "x"]
    assert RawKeys().store_keys(keys) == keys
    assert RawKeys().store_keys(keys) is not keys
    assert RawKeys.namespace == ""


def test_a_tenant_is_a_namespace_of_its_own(monkeypatch):
    monkeypatch.delenv("KVMOVE_TENANT", raising=False)
    plain = KeySpace(cache(), 16, "m")
    a = KeySpace(cache(), 16, "m", tenant="team-a")
    assert a.namespace == f"{plain.namespace}/t.team-a"
    assert a.store_keys(["p"]) == [f"kvm-{a.fingerprint}-m/t.team-a:p"]
    assert KeySpace(cache(), 16, tenant=" team-a ").namespace == f"kvm-{a.fingerprint}/t.team-a"
    monkeypatch.setenv("KVMOVE_TENANT", "env")
    assert KeySpace(cache(), 16, "m").namespace == f"{plain.namespace}/t.env"
    assert KeySpace(cache(), 16, "m", tenant="").namespace == plain.namespace
    assert KeySpace(cache(), 16, "m", tenant="  ").tenant is None


def test_tenant_names_outside_the_key_alphabet_are_hashed_never_written():
    tag = tenant_tag("team a:b/ü")
    assert tag.startswith("h.") and len(tag) == 34 and "team" not in tag
    salt = tenant_tag(salt="secret salt")
    assert salt.startswith("s.") and "secret" not in salt
    assert tenant_tag("a", "x") == f"t.a+{tenant_tag(salt='x')}"
    assert tenant_tag() == "" and tenant_head("") == ""
    assert tenant_head("t.a") == "kvmt-t.a/"


names = st.one_of(st.none(), st.text(min_size=1, max_size=70))


@given(st.tuples(names, names), st.tuples(names, names))
def test_different_tenants_and_salts_never_share_a_tag(x, y):
    """A user's salt can never name an engine tenant's key space, nor a name another one."""
    if x != y:
        assert tenant_tag(*x) != tenant_tag(*y)


def test_raw_keys_with_a_tenant_start_with_its_head(monkeypatch):
    monkeypatch.setenv("KVMOVE_TENANT", "not-read")
    assert RawKeys().store_keys(["k"]) == ["k"]
    assert RawKeys("a").store_keys(["k", "l"]) == ["kvmt-t.a/k", "kvmt-t.a/l"]
    assert RawKeys("a").namespace == "kvmt-t.a/" and RawKeys.namespace == ""


@pytest.mark.parametrize("tenant", [1, b"a", object()])
def test_a_tenant_of_another_type_is_refused(tenant):
    with pytest.raises(ValueError, match="tenant must be a str or None"):
        KeySpace(cache(), 16, tenant=tenant)
