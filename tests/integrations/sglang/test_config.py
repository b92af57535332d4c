"""Where kvmove's SGLang backend finds its store (the same sources and defaults as SGLang's
own Mooncake backend, checked against SGLang's own config loader), and that importing kvmove
never imports SGLang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
    MooncakeBaseStore,
    MooncakeStore,
    MooncakeStoreConfig,
)

from kvmove.integrations.sglang.store_config import CONFIG_PATH_VAR, store_config_for
from tests.integrations.sglang.conftest import storage_config

ENV = {"MOONCAKE_MASTER": "10.0.0.5:50051", "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
       "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9"}


@pytest.fixture
def env(monkeypatch):
    for var in ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE",
                "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
                "MOONCAKE_LOCAL_HOSTNAME", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
                "LOCAL_HOSTNAME", "MOONCAKE_CLIENT", "MOONCAKE_STANDALONE_STORAGE",
                "MOONCAKE_TENANT_ID", "KVMOVE_REPLICAS", "KVMOVE_CALL_TIMEOUT"):
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
    assert ours.local_hostname == theirs.local_hostname == "10.0.0.9"  # the environment's
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.6:7000", "protocol": "tcp"}))
    env.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    ours = store_config_for(storage_config(mla=True, page_first=True, model="m"))
    assert ours.master_address == "10.0.0.6:7000" and ours.protocol == "tcp"


MASTER = "10.0.0.7:6000"
FIELDS = ("master_address", "metadata_server", "protocol", "rdma_devices", "local_hostname",
          "global_segment_size", "tenant_id")


def configured(env, tmp_path, source: str, settings: dict, tp_rank: int = 0):
    """SGLang's storage config (tp_size 2) with the store ``settings`` in ``source``: the
    extra config, the SGLANG_HICACHE_MOONCAKE_CONFIG_PATH file (both SGLang's keys), or
    ``"env"`` (``settings`` are then environment variables)."""
    extra = None
    if source == "extra":
        extra = settings
    elif source == "file":
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps(settings))
        env.setenv(CONFIG_PATH_VAR, str(path))
    else:
        for var, value in settings.items():
            env.setenv(var, value)
    config = storage_config(mla=True, page_first=True, model="m", tp_rank=tp_rank, extra=extra)
    config.tp_size = 2
    return config


def sglang_setup(env, config) -> dict:
    """What SGLang's own MooncakeStore hands Mooncake's ``setup()`` for ``config``, as
    StoreConfig fields (a stand-in Mooncake client records the call; no store runs)."""
    calls = []

    class Client:
        def setup(self, *args, **kwargs):
            calls.append((args, kwargs))
            return 0

        def put(self, key, value):
            self.value = value
            return 0

        def is_exist(self, key):
            return 1

        def get(self, key):
            return self.value

    env.setattr(MooncakeBaseStore, "_import_mooncake_store", lambda self: Client)
    MooncakeStore(config)
    args, kwargs = calls[0]
    hostname, metadata, segment, _, protocol, devices, master = args[:7]
    return dict(master_address=master, metadata_server=metadata, protocol=protocol,
                rdma_devices=devices, local_hostname=hostname, global_segment_size=segment,
                tenant_id=kwargs.get("tenant_id", "default"))  # SGLang passes none for default


def resolved(config) -> dict:
    ours = store_config_for(config)
    return {field: getattr(ours, field) for field in FIELDS}


@pytest.mark.parametrize("source, variables, configured_name, expected", [
    ("extra", {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9"}, "10.0.0.8", "10.0.0.9"),
    ("extra", {"LOCAL_HOSTNAME": "10.0.0.4"}, "10.0.0.8", "10.0.0.4"),
    ("extra", {}, "", "localhost"),
    ("file", {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9", "LOCAL_HOSTNAME": "10.0.0.4"}, "10.0.0.8",
     "10.0.0.9"),
    ("file", {"LOCAL_HOSTNAME": "10.0.0.4"}, None, "10.0.0.4"),
    ("env", {"LOCAL_HOSTNAME": "10.0.0.4"}, None, "10.0.0.4"),
])
def test_local_hostname_as_sglang_resolves_it(env, tmp_path, source, variables,
                                              configured_name, expected):
    """The process environment wins over the configured name (one extra_config for every
    node), MOONCAKE_LOCAL_HOSTNAME first, then LOCAL_HOSTNAME, then the configured name."""
    env.delenv("MOONCAKE_LOCAL_HOSTNAME")
    for var, value in variables.items():
        env.setenv(var, value)
    settings = {} if source == "env" else {"master_server_address": MASTER, "protocol": "tcp"}
    if configured_name is not None:
        settings["local_hostname"] = configured_name
    config = configured(env, tmp_path, source, settings)
    assert MooncakeBaseStore()._load_config(config).local_hostname == expected
    assert resolved(config) == sglang_setup(env, config)
    assert resolved(config)["local_hostname"] == expected


@pytest.mark.parametrize("source", ["extra", "file", "env"])
@pytest.mark.parametrize("given, expected", [
    ("team-a", "team-a"),
    ("  team-a\t", "team-a"),      # padded: stripped
    ("", "default"),              # blank
    ("   ", "default"),
    (None, "default"),            # null (not set, in the environment)
    ("default", "default"),
])
def test_tenant_id_as_sglang_resolves_it(env, tmp_path, source, given, expected):
    """The tenant is SGLang's: the source's ``tenant_id`` (``MOONCAKE_TENANT_ID`` in the
    environment source), stripped; missing, null or blank is ``default``. It reaches
    Mooncake's ``setup()`` as SGLang's backend passes it."""
    if source == "env":
        settings = {} if given is None else {"MOONCAKE_TENANT_ID": given}
    else:
        settings = {"master_server_address": MASTER, "protocol": "tcp", "tenant_id": given}
    config = configured(env, tmp_path, source, settings)
    assert MooncakeBaseStore()._load_config(config).tenant_id == expected
    assert resolved(config) == sglang_setup(env, config)
    assert resolved(config)["tenant_id"] == expected


@pytest.mark.parametrize("source", ["extra", "file"])
@pytest.mark.parametrize("settings, expected", [
    ({}, "default"),                       # the key missing: not MOONCAKE_TENANT_ID's value
    ({"tenant_id": "team-a"}, "team-a"),   # the key wins
    ({"tenant_id": 7}, "7"),               # SGLang takes str() of the value
])
def test_tenant_id_of_a_configured_source(env, tmp_path, source, settings, expected):
    """With an extra config or a config file SGLang reads only its ``tenant_id`` key, never
    ``MOONCAKE_TENANT_ID`` (that variable belongs to the environment source)."""
    env.setenv("MOONCAKE_TENANT_ID", "team-b")
    config = configured(env, tmp_path, source, {"master_server_address": MASTER, **settings})
    assert MooncakeBaseStore()._load_config(config).tenant_id == expected
    assert resolved(config) == sglang_setup(env, config)


@pytest.mark.parametrize("source", ["extra", "file", "env"])
def test_kvmoves_own_variables_apply_to_every_source(env, tmp_path, source):
    """KVMOVE_REPLICAS and KVMOVE_CALL_TIMEOUT have no SGLang name: they are read from the
    environment whichever source configures the store (they were dropped with an extra
    config or a config file), and a bad value names its variable."""
    env.setenv("KVMOVE_REPLICAS", "2")
    env.setenv("KVMOVE_CALL_TIMEOUT", "3.5")
    settings = ({"MOONCAKE_MASTER": MASTER} if source == "env"
                else {"master_server_address": MASTER, "protocol": "tcp"})
    ours = store_config_for(configured(env, tmp_path, source, settings))
    assert (ours.replicas, ours.call_timeout) == (2, 3.5)
    env.setenv("KVMOVE_REPLICAS", "0")
    with pytest.raises(ValueError, match="KVMOVE_REPLICAS"):
        store_config_for(configured(env, tmp_path, source, settings))


def test_the_environ_argument_is_the_environment(env):
    """Given ``environ``, the configured sources read it, never the process environment."""
    config = storage_config(mla=True, page_first=True, model="m",
                            extra={"master_server_address": MASTER})
    ours = store_config_for(config, environ={"MOONCAKE_PROTOCOL": "tcp",
                                             "LOCAL_HOSTNAME": "10.0.0.4"})
    assert (ours.protocol, ours.local_hostname) == ("tcp", "10.0.0.4")


JSON_DEVICES = '{"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}'


@pytest.mark.parametrize("source, devices, tp_rank, expected", [
    ("env", JSON_DEVICES, 1, "mlx5_1,mlx5_2"),
    ("extra", JSON_DEVICES.replace(" ", ""), 1, "mlx5_1,mlx5_2"),
    ("extra", JSON_DEVICES, 0, "mlx5_0"),
    ("file", '{"0": "mlx5_0"}', 1, ""),           # no entry for this rank
    ("extra", '{"0":"mlx5_0",}', 0, ""),           # malformed JSON
])
def test_per_rank_device_map_as_sglang_resolves_it(env, tmp_path, source, devices, tp_rank,
                                                   expected):
    """A device list given as JSON {tp_rank: devices} gives Mooncake this rank's devices."""
    if source == "env":
        settings = {"MOONCAKE_DEVICE": devices}
    else:
        settings = {"master_server_address": MASTER, "device_name": devices}
    config = configured(env, tmp_path, source, settings, tp_rank=tp_rank)
    assert resolved(config) == sglang_setup(env, config)
    assert resolved(config)["rdma_devices"] == expected


@pytest.mark.parametrize("source, settings, named", [
    ("extra", {"master_server_address": MASTER, "standalone_storage": True,
               "client_server_address": "10.0.0.7:50052"}, "standalone_storage"),
    ("extra", {"client_server_address": "10.0.0.7:50052"}, "client_server_address"),
    ("file", {"master_server_address": MASTER, "standalone_storage": True},
     "standalone_storage"),
    ("file", {"client_server_address": "10.0.0.7:50052"}, "client_server_address"),
    ("env", {"MOONCAKE_CLIENT": "10.0.0.7:50052"}, "MOONCAKE_CLIENT"),
    ("env", {"MOONCAKE_STANDALONE_STORAGE": "true"}, "MOONCAKE_STANDALONE_STORAGE"),
])
def test_standalone_storage_is_refused_naming_the_setting(env, tmp_path, source, settings,
                                                          named):
    """Standalone storage (a separate mooncake_client serves the node) is not served."""
    config = configured(env, tmp_path, source, settings)
    theirs = MooncakeBaseStore()._load_config(config)
    assert theirs.standalone_storage or theirs.client_server_address  # SGLang reads it here
    with pytest.raises(ValueError, match=named):
        store_config_for(config)


def test_mooncake_client_variable_is_not_read_with_an_extra_config(env, tmp_path):
    """As in SGLang, MOONCAKE_CLIENT belongs to the environment source only."""
    env.setenv("MOONCAKE_CLIENT", "10.0.0.7:50052")
    config = configured(env, tmp_path, "extra", {"master_server_address": MASTER})
    assert MooncakeBaseStore()._load_config(config).client_server_address is None
    assert resolved(config) == sglang_setup(env, config)


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
