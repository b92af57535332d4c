"""The connector's store config from vLLM's Mooncake JSON: the address its client advertises
(its segment's, which peers on other nodes reach) is the one vLLM's own
``MooncakeStoreConnector`` advertises for the same environment."""

from __future__ import annotations

import json

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import rdma_utils
from vllm.distributed.mooncake_store import MooncakeStoreConfig, setup_mooncake_store
from vllm.utils.network_utils import get_ip

from kvmove.integrations.vllm.store_config import connector_store_config, local_hostname

VARS = ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_LOCAL_HOSTNAME", "VLLM_HOST_IP",
        "MOONCAKE_TENANT_ID")


def vllm_hostname() -> str:
    """What vLLM's MooncakeStoreWorker passes to the store's setup (store/worker.py)."""
    return rdma_utils.get_requester_local_hostname(get_ip())


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "master_server_address": "10.0.0.1:50051", "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp", "device_name": "", "global_segment_size": "1gb"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    return path


@pytest.mark.parametrize("env", [
    {},  # this node's IP, as vLLM's get_ip() finds it
    {"VLLM_HOST_IP": "10.1.2.3"},
    {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.7"},
    {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "  node-7.cluster  "},  # stripped, as vLLM's
    {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "   ", "VLLM_HOST_IP": "10.1.2.3"},  # blank: unset
    {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.7", "VLLM_HOST_IP": "10.1.2.3"},
])
def test_local_hostname_is_vllms(config_file, monkeypatch, env):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    expected = vllm_hostname()
    assert expected not in ("", "localhost")
    assert connector_store_config().local_hostname == expected
    assert local_hostname() == expected


def test_kvmove_local_hostname_variable_is_a_fallback(config_file, monkeypatch):
    """``MOONCAKE_LOCAL_HOSTNAME`` (kvmove's variable, which vLLM does not read) is used
    when vLLM's override is unset, and vLLM's override wins over it."""
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.9.9.9")
    assert connector_store_config().local_hostname == "10.9.9.9"
    monkeypatch.setenv("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "10.0.0.7")
    assert connector_store_config().local_hostname == vllm_hostname() == "10.0.0.7"


def test_an_explicit_environment_is_honoured(config_file):
    env = {"MOONCAKE_CONFIG_PATH": str(config_file),
           "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.4.4.4"}
    assert connector_store_config(env).local_hostname == "10.4.4.4"
    assert local_hostname({"VLLM_HOST_IP": "10.5.5.5"}) == "10.5.5.5"


MISSING = object()


def vllm_tenant(path) -> str:
    """The tenant vLLM's own Mooncake clients hand ``setup()`` for the config file ``path``
    (``MooncakeStoreConfig.load_from_config``, then ``setup_mooncake_store``; a stand-in
    store records the call)."""
    calls = []

    class Store:
        def setup(self, *args, **kwargs):
            calls.append(kwargs)
            return 0

    setup_mooncake_store(Store(), MooncakeStoreConfig.from_file(str(path)), "10.0.0.1")
    return calls[0].get("tenant_id", "default")  # vLLM passes none for the default


def with_tenant(config_file, tenant):
    raw = json.loads(config_file.read_text())
    if tenant is not MISSING:
        raw["tenant_id"] = tenant
    config_file.write_text(json.dumps(raw))


@pytest.mark.parametrize("tenant, expected", [
    ("team-a", "team-a"),
    ("  team-a\t", "team-a"),  # padded: stripped
    ("", "default"),          # blank
    ("   ", "default"),
    (None, "default"),        # null
    (MISSING, "default"),
    ("default", "default"),
])
def test_tenant_id_is_vllms(config_file, monkeypatch, tenant, expected):
    """The tenant in vLLM's Mooncake JSON, resolved as vLLM's own clients resolve it; vLLM
    reads no MOONCAKE_TENANT_ID with the file, and neither does the connector."""
    with_tenant(config_file, tenant)
    monkeypatch.setenv("MOONCAKE_TENANT_ID", "team-b")
    assert MooncakeStoreConfig.load_from_config().tenant_id == expected
    assert connector_store_config().tenant_id == vllm_tenant(config_file) == expected


@pytest.mark.parametrize("tenant", [7, True, ["team-a"], {"name": "team-a"}])
def test_a_tenant_id_that_is_not_a_string_is_refused_as_vllm_does(config_file, tenant):
    with_tenant(config_file, tenant)
    with pytest.raises(TypeError, match="tenant_id must be a string or null"):
        MooncakeStoreConfig.load_from_config()
    with pytest.raises(TypeError, match="tenant_id must be a string or null") as e:
        connector_store_config()
    assert str(config_file) in str(e.value)


@pytest.mark.parametrize("value, expected", [("team-a", "team-a"), (" team-a ", "team-a"),
                                             ("  ", "default")])
def test_without_the_file_the_tenant_is_kvmoves_variable(value, expected):
    """Without vLLM's JSON the connector reads kvmove's MOONCAKE_* variables, where
    MOONCAKE_TENANT_ID names the tenant (normalised the same way)."""
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051", "MOONCAKE_TENANT_ID": value}
    assert connector_store_config(env).tenant_id == expected
