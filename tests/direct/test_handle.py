"""A receiver's handle and the transport settings, in one process: the handle carries the
pool's geometry and exactly its registered regions, travels as a str, and a parse refuses
anything that is not a handle this version wrote or whose pages would leave its regions;
the ``MOONCAKE_*`` settings are checked as the store checks them, naming the variable."""

from __future__ import annotations

import json

import pytest

import kvmove
from kvmove.direct.handle import PageHandle
from kvmove.store.transfer_engine import TransportSettings
from tests.support.direct_pools import GUARD, LAYOUTS, make_pool


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_handle_names_the_pool_and_only_its_bytes(layout):
    spec = {"layout": layout, "page_tokens": 4, "pages": 5,
            "buffers": {"kv": [3, 656], "idx": [2, 132]}, "extra_tokens": 0}
    pool, wholes, views = make_pool(spec, seed=0)
    with kvmove.PageReceiver(pool, hostname="127.0.0.1") as rx:
        assert isinstance(rx.handle, str) and rx.peer.startswith("127.0.0.1:")
        handle = PageHandle.parse(rx.handle)
        assert PageHandle.parse(handle.encode()) == handle == PageHandle.parse(handle)
        assert (handle.peer, handle.layout, handle.page_tokens, handle.num_pages) == (
            rx.peer, layout, 4, 5)
        assert handle.geometry == {"kv": (3, 656), "idx": (2, 132)}
        for place in handle.buffers:  # the region is the pool's bytes, not a guard byte
            whole = wholes[place.name]
            assert place.address == whole.data_ptr() + GUARD
            assert place.nbytes == views[place.name].numel()
    assert rx.closed


def test_a_parse_refuses_what_is_not_a_handle():
    pool, _, _ = make_pool({"layout": "layer_first", "page_tokens": 2, "pages": 3,
                            "buffers": {"kv": [2, 64], "v": [2, 64]}}, seed=0)
    with kvmove.PageReceiver(pool, hostname="127.0.0.1") as rx:
        good = json.loads(rx.handle)

    def variant(**changes):
        body = json.loads(json.dumps(good))
        for key, value in changes.items():
            if key.startswith("b0_"):
                body["buffers"][0][key[3:]] = value
            else:
                body[key] = value
        return json.dumps(body)

    second = good["buffers"][1]
    cases = [
        (TypeError, "must be a str", 42),
        (ValueError, "not JSON", "{"),
        (ValueError, "not a kvmove page handle", json.dumps([1])),
        (ValueError, "version", variant(version=0)),
        (ValueError, "fields", variant(extra=1)),
        (ValueError, "layout must be one of", variant(layout="token_first")),
        (ValueError, "page_tokens must be a positive int", variant(page_tokens=0)),
        (ValueError, "peer must be", variant(peer="a b:1")),
        (ValueError, "buffer names repeat", variant(b0_name="v")),
        (ValueError, "row_bytes must be a positive int", variant(b0_row_bytes=True)),
        (ValueError, "a buffer has fields", variant(b0_stride=1)),
        (ValueError, "not inside its region", variant(b0_origin=good["buffers"][0]["origin"]
                                                      + 1)),
        (ValueError, "page_stride 128", variant(b0_page_stride=64)),
        (ValueError, "overlap", variant(b0_address=second["address"],
                                        b0_origin=second["origin"])),
        (ValueError, "too long", "x" * 70000),
    ]
    for error, match, text in cases:
        with pytest.raises(error, match=match):
            PageHandle.parse(text)


def test_transport_settings_come_from_the_mooncake_variables():
    env = {"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7:12345", "MOONCAKE_PROTOCOL": "RDMA",
           "MOONCAKE_DEVICE": " mlx5_0,mlx5_1 ", "MOONCAKE_MASTER": "ignored:1"}
    s = TransportSettings.from_env(env)
    assert (s.local_hostname, s.protocol, s.rdma_devices, s.metadata_server) == (
        "10.0.0.7:12345", "rdma", "mlx5_0,mlx5_1", "P2PHANDSHAKE")
    assert s.p2p and s.host == "10.0.0.7"
    assert TransportSettings.from_env({}, local_hostname="[fe80::1]:5").host == "[fe80::1]"
    assert not TransportSettings.from_env(
        {"MOONCAKE_TE_META_DATA_SERVER": "etcd://10.0.0.1:2379"}).p2p
    with pytest.raises(ValueError, match="MOONCAKE_DEVICE: rdma_devices must not contain"):
        TransportSettings.from_env({"MOONCAKE_DEVICE": "mlx5_0 mlx5_1"})
    with pytest.raises(ValueError, match="MOONCAKE_LOCAL_HOSTNAME: local_hostname"):
        TransportSettings.from_env({"MOONCAKE_LOCAL_HOSTNAME": "a host"})
    with pytest.raises(ValueError, match=r"^local_hostname"):  # an argument, not a variable
        TransportSettings.from_env({}, local_hostname="a host")


def test_a_receiver_refuses_what_is_not_a_host_pool_and_buffers_that_share_memory():
    import torch

    with pytest.raises(TypeError, match=r"kvmove\.HostPool"):
        kvmove.PageReceiver({"kv": torch.zeros(2, 8, 4, dtype=torch.uint8)})
    t = torch.zeros(2, 8, 64, dtype=torch.uint8)
    shared = kvmove.HostPool({"a": t, "b": t}, page_tokens=4, layout="layer_first")
    with pytest.raises(ValueError, match="overlap"):
        kvmove.PageReceiver(shared)
