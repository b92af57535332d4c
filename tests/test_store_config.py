"""StoreConfig: fields, dicts, and SGLang's MOONCAKE_* environment variables."""

from __future__ import annotations

import pytest

from kvmove import StoreConfig
from kvmove.store_config import parse_size


def test_from_env_reads_sglang_names():
    env = {
        "MOONCAKE_MASTER": "10.0.0.5:50051",
        "MOONCAKE_PROTOCOL": "RDMA",
        "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
        "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.5:8080/metadata",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7",
    }
    c = StoreConfig.from_env(env)
    assert c.master_address == "10.0.0.5:50051"
    assert c.protocol == "rdma" and c.rdma_devices == "mlx5_0,mlx5_1"
    assert c.metadata_server == "http://10.0.0.5:8080/metadata"
    assert c.global_segment_size == 4 << 30 and c.local_hostname == "10.0.0.7"


def test_from_env_defaults_and_overrides():
    c = StoreConfig.from_env({"MOONCAKE_MASTER": "m:1"}, max_batch_keys=7)
    assert (c.protocol, c.metadata_server, c.rdma_devices) == ("tcp", "P2PHANDSHAKE", "")
    assert c.global_segment_size == 4 << 30 and c.max_batch_keys == 7


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "lots"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "-1"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4 parsecs"),
        ("MOONCAKE_MASTER", "no-port"),
        ("MOONCAKE_MASTER", "host:99999"),
        ("MOONCAKE_LOCAL_BUFFER_SIZE", "1.5 bananas"),
    ],
)
def test_malformed_env_value_names_the_variable(var, value):
    env = {"MOONCAKE_MASTER": "m:1", var: value}
    with pytest.raises(ValueError, match=var):
        StoreConfig.from_env(env)


def test_missing_master_names_the_variable():
    with pytest.raises(ValueError, match="MOONCAKE_MASTER is not set"):
        StoreConfig.from_env({"MOONCAKE_PROTOCOL": "tcp"})


@pytest.mark.parametrize(
    ("text", "size"),
    [(4096, 4096), ("4096", 4096), ("4gb", 4 << 30), ("4GB", 4 << 30), ("512 MB", 512 << 20),
     ("1.5g", 3 << 29), ("16m", 16 << 20), ("2KiB", 2048), ("0", 0)],
)
def test_sizes(text, size):
    assert parse_size(text) == size


def test_from_dict_and_coerce():
    c = StoreConfig.coerce({"master_server_address": "h:2", "device_name": "mlx5_0",
                            "global_segment_size": "1gb"})
    assert c.master_address == "h:2" and c.rdma_devices == "mlx5_0"
    assert c.global_segment_size == 1 << 30
    assert StoreConfig.coerce(c) is c
    assert c.replace(replica_count=2).replica_count == 2
    with pytest.raises(ValueError, match="unknown store config field 'segment'"):
        StoreConfig.from_dict({"master_address": "h:2", "segment": 1})
    with pytest.raises(ValueError, match="needs 'master_address'"):
        StoreConfig.from_dict({"protocol": "tcp"})
    with pytest.raises(TypeError, match="StoreConfig or a dict"):
        StoreConfig.coerce("h:2")


@pytest.mark.parametrize(
    ("field", "value"),
    [("replica_count", 0), ("max_batch_keys", -3), ("connect_timeout", 0),
     ("protocol", " "), ("local_buffer_size", "big"), ("detect_exists", "yes")],
)
def test_bad_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        StoreConfig(master_address="h:1", **{field: value})
