"""StoreConfig: fields, dicts, and SGLang's MOONCAKE_* environment variables."""

from __future__ import annotations

import time

import pytest

from kvmove import MooncakeStore, StoreConfig
from kvmove.store.config import parse_size


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
        # addresses: a scheme, a path, spaces, non-ASCII digits, a newline inside, an
        # IPv6 address without brackets, shell metacharacters, no host, port 0
        ("MOONCAKE_MASTER", "http://10.0.0.5:50051"),
        ("MOONCAKE_MASTER", "10.0.0.5:50051/x"),
        ("MOONCAKE_MASTER", "my host:50051"),
        ("MOONCAKE_MASTER", "h:\u0665\u0660"),
        ("MOONCAKE_MASTER", "h\n:1"),
        ("MOONCAKE_MASTER", "::1:50051"),
        ("MOONCAKE_MASTER", "h:1;rm -rf /"),
        ("MOONCAKE_MASTER", ":50051"),
        ("MOONCAKE_MASTER", "h:0"),
        # transports, devices, metadata servers, hostnames
        ("MOONCAKE_PROTOCOL", "carrier pigeon"),
        ("MOONCAKE_PROTOCOL", "rdma;ls"),
        ("MOONCAKE_PROTOCOL", "tcp\x00"),
        ("MOONCAKE_DEVICE", "mlx5_0, mlx5_1"),
        ("MOONCAKE_DEVICE", "mlx5_0\nmlx5_1"),
        ("MOONCAKE_TE_META_DATA_SERVER", "etcd://a b:2379"),
        ("MOONCAKE_TE_META_DATA_SERVER", "P2P\x07HANDSHAKE"),
        ("MOONCAKE_LOCAL_HOSTNAME", "my host"),
        ("MOONCAKE_LOCAL_HOSTNAME", "h;touch x"),
        ("MOONCAKE_LOCAL_HOSTNAME", "h:port"),
        # sizes: not numbers, floats, hex, non-ASCII digits, fractions of a byte, too large
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "nan"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "inf"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1e9"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0x10"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "\u0661\u0660"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1.5"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "99999999999999999999tb"),
        ("MOONCAKE_LOCAL_BUFFER_SIZE", "-5mb"),
    ],
)
def test_malformed_env_value_names_the_variable(var, value):
    env = {"MOONCAKE_MASTER": "m:1", var: value}
    with pytest.raises(ValueError, match=var):
        StoreConfig.from_env(env)


def test_malformed_env_value_fails_before_any_connection():
    # MooncakeStore.from_env checks the variables before it probes the master.
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        MooncakeStore.from_env({"MOONCAKE_MASTER": "127.0.0.1:1",
                                "MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})
    assert time.monotonic() - t0 < 1
    with pytest.raises(ValueError, match="MOONCAKE_PROTOCOL"):
        StoreConfig.from_env({"MOONCAKE_MASTER": "m:1", "MOONCAKE_PROTOCOL": 7})


@pytest.mark.parametrize(
    ("var", "value", "field", "parsed"),
    [
        ("MOONCAKE_MASTER", "[::1]:50051", "master_address", "[::1]:50051"),
        ("MOONCAKE_MASTER", " node-1.cluster.local:50051 ", "master_address",
         "node-1.cluster.local:50051"),
        ("MOONCAKE_TE_META_DATA_SERVER", "etcd://10.0.0.1:2379", "metadata_server",
         "etcd://10.0.0.1:2379"),
        ("MOONCAKE_TE_META_DATA_SERVER", "http://h:8080/metadata", "metadata_server",
         "http://h:8080/metadata"),
        ("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.7:12345", "local_hostname", "10.0.0.7:12345"),
        ("MOONCAKE_LOCAL_HOSTNAME", "[fe80::1]", "local_hostname", "[fe80::1]"),
        ("MOONCAKE_PROTOCOL", "NVLink", "protocol", "nvlink"),
        ("MOONCAKE_DEVICE", "mlx5_0,mlx5_1", "rdma_devices", "mlx5_0,mlx5_1"),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0.5gb", "global_segment_size", 1 << 29),
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "", "global_segment_size", 4 << 30),  # unset
    ],
)
def test_well_formed_env_values_are_accepted(var, value, field, parsed):
    env = {"MOONCAKE_MASTER": "m:1", var: value}
    assert getattr(StoreConfig.from_env(env), field) == parsed


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
    assert c.replace(replicas=2).replicas == 2
    assert c.replace(replica_count=3).replica_count == 3  # the earlier name still reads
    assert StoreConfig.from_dict({"master_address": "h:2", "replica_num": 2}).replicas == 2
    with pytest.raises(ValueError, match="unknown store config field 'segment'"):
        StoreConfig.from_dict({"master_address": "h:2", "segment": 1})
    with pytest.raises(ValueError, match="needs 'master_address'"):
        StoreConfig.from_dict({"protocol": "tcp"})
    with pytest.raises(TypeError, match="StoreConfig or a dict"):
        StoreConfig.coerce("h:2")


@pytest.mark.parametrize(
    ("field", "value"),
    [("replicas", 0), ("replicas", "two"), ("max_batch_keys", -3), ("connect_timeout", 0),
     ("protocol", " "), ("local_buffer_size", "big"), ("detect_exists", "yes"),
     # waits no thread can make (they overflow, or a put given up is never tracked)
     ("connect_timeout", float("inf")), ("connect_timeout", "inf"), ("connect_timeout", 1e10),
     ("connect_timeout", float("nan")), ("connect_timeout", True), ("call_timeout", 1e10),
     ("call_timeout", float("inf")), ("call_timeout", -1), ("call_timeout", "soon")],
)
def test_bad_fields_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        StoreConfig(master_address="h:1", **{field: value})


def test_replicas_from_the_environment():
    env = {"MOONCAKE_MASTER": "h:1", "KVMOVE_REPLICAS": "2"}
    assert StoreConfig.from_env(env).replicas == 2
    assert StoreConfig.from_env({"MOONCAKE_MASTER": "h:1"}).replicas == 1
    with pytest.raises(ValueError, match="KVMOVE_REPLICAS: replicas must be a positive int"):
        StoreConfig.from_env({**env, "KVMOVE_REPLICAS": "0"})


def test_a_bad_override_is_not_blamed_on_the_environment():
    env = {"MOONCAKE_MASTER": "h:1", "KVMOVE_REPLICAS": "2"}
    with pytest.raises(ValueError, match="replicas must be a positive int") as caught:
        StoreConfig.from_env(env, replicas=0)
    assert "KVMOVE_REPLICAS" not in str(caught.value)
