"""The connector's store config from vLLM's Mooncake JSON: the address its client advertises
(its segment's, which peers on other nodes reach) is the one vLLM's own
``MooncakeStoreConnector`` advertises for the same environment."""

from __future__ import annotations

import json

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import rdma_utils
from vllm.utils.network_utils import get_ip

from kvmove.integrations.vllm.store_config import connector_store_config, local_hostname

VARS = ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_LOCAL_HOSTNAME", "VLLM_HOST_IP")


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
