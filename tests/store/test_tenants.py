"""Mooncake tenants: ``StoreConfig.tenant_id`` reaches Mooncake's ``setup()``, and on a
master that keeps tenants apart (``-enable_multi_tenants``) a client of one tenant never
sees another tenant's objects; ``default`` (blank, ``None``) is the tenant of a client that
names none. A real embedded master."""

from __future__ import annotations

import pytest

import kvmove
from kvmove import Status, StoreConfig
from kvmove.memory.host_memory import HostMemory
from tests.support.tenants import multi_tenant_store

pytestmark = pytest.mark.store

@pytest.fixture
def tenants(tmp_path):
    """A default-tenant store on a master that keeps tenants apart, and a client of
    tenant ``team-a`` on it."""
    default = multi_tenant_store(tmp_path)
    team = kvmove.MooncakeStore(StoreConfig(master_address=default.address, tenant_id="team-a",
                                            global_segment_size=64 << 20))
    yield default, team
    team.close()
    default.close()


def one_object(key: str, value: int):
    memory = HostMemory(4096, pin=None)
    memory.tensor.fill_(value)
    desc = kvmove.Descriptors([key], [[memory.address]], [[4096]],
                              regions=[(memory.address, memory.nbytes)])
    return memory, desc


def test_a_tenant_sees_only_its_own_objects(tenants):
    default, team = tenants
    memory, desc = one_object("shared-name", 7)
    try:
        assert default.put(desc) == [Status.OK]
        assert default.exists(["shared-name"]) == [True]
        assert team.exists(["shared-name"]) == [False]  # another tenant's key space
        memory.tensor.fill_(9)
        assert team.put(desc) == [Status.OK]  # the same name, its own object
        memory.tensor.zero_()
        assert team.get(desc) == [Status.OK]
        assert bool((memory.tensor == 9).all())
        assert default.get(desc) == [Status.OK]
        assert bool((memory.tensor == 7).all())
    finally:
        for store in tenants:
            store.unregister([(memory.address, memory.nbytes)])
        memory.close()


@pytest.mark.parametrize(("given", "tenant"), [(None, "default"), ("", "default"),
                                               ("  ", "default"), (" team-a ", "team-a"),
                                               ("team a", "team a")])
def test_tenant_id_is_normalised_as_the_engines_do(given, tenant):
    assert StoreConfig(master_address="h:1", tenant_id=given).tenant_id == tenant


@pytest.mark.parametrize("bad", ["a\nb", "a\x00", 7, b"team"])
def test_a_malformed_tenant_id_is_refused(bad):
    with pytest.raises(ValueError, match="tenant_id"):
        StoreConfig(master_address="h:1", tenant_id=bad)


def test_the_tenant_comes_from_the_environment():
    env = {"MOONCAKE_MASTER": "h:1", "MOONCAKE_TENANT_ID": "team-a"}
    assert StoreConfig.from_env(env).tenant_id == "team-a"
    assert StoreConfig.from_env({"MOONCAKE_MASTER": "h:1"}).tenant_id == "default"
