"""Where kvmove's SGLang backend finds its store (the same sources and defaults as SGLang's
own Mooncake backend, checked against SGLang's own config loader), and that importing kvmove
never imports SGLang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

from kvmove.integrations.sglang.store_config import store_config_for
from tests.integrations.sglang.conftest import storage_config

ENV = {"MOONCAKE_MASTER": "10.0.0.5:50051", "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
       "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9"}


@pytest.fixture
def env(monkeypatch):
    for var in ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE",
                "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                "MOONCAKE_LOCAL_HOSTNAME", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(var, raising=False)
    for var, value in ENV.items():
        monkeypatch.setenv(var, value)
    return monkeypatch


def test_environment_with_sglangs_defaults(env):
    theirs = MooncakeStoreConfig.load_from_env()
    config = storage_config(mla=True, page_first=True, model="m")
    config.tp_size, config.pp_size = 4, 2
    ours = store_config_for(config)
    assert ours.master_address == theirs.master_server_address == "10.0.0.5:50051"
    assert ours.protocol == theirs.protocol == "rdma"
    assert ours.rdma_devices == theirs.device_name == "mlx5_0,mlx5_1"
    assert ours.metadata_server == theirs.metadata_server == "P2PHANDSHAKE"
    assert ours.local_hostname == "10.0.0.9"
    assert ours.global_segment_size == theirs.global_segment_size // 8 == (4 << 30) // 8


def test_environment_values_win_over_defaults(env):
    env.setenv("MOONCAKE_PROTOCOL", "tcp")
    env.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2gb")
    ours = store_config_for(storage_config(mla=True, page_first=True, model="m"))
    assert ours.protocol == "tcp" and ours.global_segment_size == 2 << 30


def test_extra_config_and_config_file(env, tmp_path):
    extra = {"master_server_address": "10.0.0.7:6000", "protocol": "tcp",
             "global_segment_size": 1 << 30, "local_hostname": "10.0.0.8"}
    ours = store_config_for(storage_config(mla=True, page_first=True, model="m", extra=extra))
    theirs = MooncakeStoreConfig.load_from_extra_config(extra)
    assert ours.master_address == theirs.master_server_address == "10.0.0.7:6000"
    assert ours.protocol == theirs.protocol == "tcp"
    assert ours.global_segment_size == theirs.global_segment_size == 1 << 30
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.6:7000", "protocol": "tcp"}))
    env.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    ours = store_config_for(storage_config(mla=True, page_first=True, model="m"))
    assert ours.master_address == "10.0.0.6:7000" and ours.protocol == "tcp"


def test_no_master_is_a_clear_error(env):
    env.delenv("MOONCAKE_MASTER")
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        store_config_for(storage_config(mla=True, page_first=True, model="m"))


def test_importing_kvmove_does_not_import_sglang():
    code = "import kvmove, kvmove.memory.host_pool, sys; print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] == 'sglang'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]"
