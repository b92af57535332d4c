"""The transport's limits, kept in one place per protocol (kvmove.store.transport_limits),
and how the store cuts a batch by them."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import kvmove
from kvmove.store.transport_limits import (
    TCP_QUEUE_VARS,
    TransportLimits,
    limits_for,
    prepare_environment,
)
from tests.support.staging_data import make_staging
from tests.support.store_state import swap_client

pytestmark = pytest.mark.store


def test_tcp_limits_follow_the_queue_variables():
    default = limits_for("tcp", {})
    assert (default.call_spans, default.inflight_spans) == (1024, 1024)
    raised = limits_for("tcp", dict.fromkeys(TCP_QUEUE_VARS, "65535"))
    assert (raised.call_spans, raised.inflight_spans) == (8192, 8192)
    assert raised.side_by_side == 1  # a put's calls one at a time: measured faster over TCP
    small = limits_for("tcp", {TCP_QUEUE_VARS[0]: "300"})
    assert (small.call_spans, small.inflight_spans) == (300, 300)
    junk = limits_for("tcp", {TCP_QUEUE_VARS[0]: "lots"})  # Mooncake's default then
    assert junk.inflight_spans == 1024


def test_other_protocols_and_overrides():
    rdma = limits_for("rdma", {})
    assert (rdma.call_spans, rdma.inflight_spans) == (1024, 4096)
    assert "not measured" in rdma.basis
    mine = limits_for("tcp", {}, call_spans=64, inflight_spans=128)
    assert (mine.call_spans, mine.inflight_spans) == (64, 128)
    assert limits_for("tcp", {}, call_spans=5000).call_spans == 1024  # never above in flight
    with pytest.raises(ValueError, match="call_spans"):
        TransportLimits(0, 10, "x")
    with pytest.raises(ValueError, match="side_by_side"):
        TransportLimits(10, 10, "x", side_by_side=0)
    with pytest.raises(ValueError, match="call_bytes"):
        TransportLimits(10, 10, "x", call_bytes=0)
    assert rdma.call_bytes == mine.call_bytes == 256 << 20


def test_batches_are_cut_by_bytes_too(keyspace):
    # 12 keys of 2 x 4 KiB spans (8 KiB objects) with 20 KiB a call: calls of 2 keys, and
    # a key larger than that alone; every byte reads back.
    with kvmove.MooncakeStore.embedded(global_segment_size="64mb") as store:
        store.limits = dataclasses.replace(store.limits, call_bytes=20 << 10)
        staging = make_staging({"a": (2, 4096)}, num_slots=24, page_tokens=1, seed=3)
        desc = kvmove.describe(staging, list(range(12)), keyspace(12))
        assert [(c.start, c.stop) for c in store._span_chunks(desc)] == [
            (a, a + 2) for a in range(0, 12, 2)]
        assert store.put(desc).all_ok
        got = store.get(kvmove.describe(staging, list(range(12, 24)), desc.keys))
        assert got.all_ok
        t = staging.tensor("a")
        assert torch.equal(t[:, 12:24], t[:, :12])
        store.limits = dataclasses.replace(store.limits, call_bytes=4 << 10)
        assert len(store._span_chunks(desc)) == 12  # each key alone, none left out


def test_prepare_environment_raises_tcp_queues_unless_set():
    env: dict[str, str] = {}
    prepare_environment("tcp", env)
    assert env == dict.fromkeys(TCP_QUEUE_VARS, "65535")
    mine = {TCP_QUEUE_VARS[0]: "2048"}
    prepare_environment("tcp", mine)
    assert mine[TCP_QUEUE_VARS[0]] == "2048" and mine[TCP_QUEUE_VARS[1]] == "65535"
    other: dict[str, str] = {}
    prepare_environment("rdma", other)
    assert other == {}


def test_store_config_bound_fields():
    config = kvmove.StoreConfig(master_address="h:1")
    assert config.call_timeout == 10.0 and config.max_call_spans is None
    env = {"MOONCAKE_MASTER": "h:1", "KVMOVE_CALL_TIMEOUT": "2.5"}
    assert kvmove.StoreConfig.from_env(env).call_timeout == 2.5
    for bad in (0, -1, "soon", float("inf"), True):
        with pytest.raises(ValueError, match="call_timeout"):
            kvmove.StoreConfig(master_address="h:1", call_timeout=bad)
    with pytest.raises(ValueError, match="max_call_spans"):
        kvmove.StoreConfig(master_address="h:1", max_call_spans=0)
    with pytest.raises(ValueError, match="KVMOVE_CALL_TIMEOUT"):
        kvmove.StoreConfig.from_env({**env, "KVMOVE_CALL_TIMEOUT": "x"})


class _CountingCalls:
    """A Mooncake client that forwards every call and records each batch call's name, keys
    and spans, and the most of them in flight at once."""

    def __init__(self, real):
        self._real = real
        self.calls: list[tuple[str, int, int]] = []
        self.most = 0
        self._active = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if not name.startswith("batch_"):
            return fn

        def counted(keys, *args):
            spans = sum(map(len, args[0])) if name.endswith("multi_buffers") else 0
            with self._lock:
                self.calls.append((name, len(keys), spans))
                self._active += 1
                self.most = max(self.most, self._active)
            try:
                return fn(keys, *args)
            finally:
                with self._lock:
                    self._active -= 1

        counted.__name__, counted.__self__ = name, self  # as a bound method's
        return counted


def test_batches_are_cut_by_spans_and_keys(keyspace):
    # 40 keys of 9 spans (3 layers x 3 buffers) = 360 spans; 100 spans per call and 16
    # keys per call cut it into calls of 11 keys (99 spans), one after the other; every
    # byte reads back.
    with kvmove.MooncakeStore.embedded(global_segment_size="64mb", max_call_spans=100,
                                       max_batch_keys=16) as store:
        staging = make_staging({"a": (3, 132), "b": (3, 656), "c": (3, 4)}, num_slots=80,
                               page_tokens=2, seed=7)
        keys = keyspace(40)
        counted = swap_client(store, _CountingCalls)
        calls = counted.calls
        assert store.put(kvmove.describe(staging, list(range(40)), keys)).all_ok
        puts = [c for c in calls if c[0] == "batch_put_from_multi_buffers"]
        assert [c[1] for c in puts] == [11, 11, 11, 7]  # in order, one at a time
        assert max(c[2] for c in puts) <= 100
        assert counted.most == 1  # never two calls of one put in flight
        calls.clear()
        got = store.get(kvmove.describe(staging, list(range(40, 80)), keys))
        assert got.all_ok and got.late is None
        assert [c[1] for c in calls] == [11, 11, 11, 7]
        for name in ("a", "b", "c"):
            t = staging.tensor(name)
            assert torch.equal(t[:, 40:80], t[:, :40])
