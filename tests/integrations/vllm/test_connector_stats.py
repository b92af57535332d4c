"""The connector's stats through vLLM's own interface: a worker mover's saves and loads
become ``KVMoveConnectorStats`` of the interval (bytes and the seconds they took), which
aggregate, reduce and reach Prometheus under vLLM's offloading connector's names."""

from __future__ import annotations

import uuid
from functools import partial
from types import SimpleNamespace

import prometheus_client
import torch

import kvmove
from kvmove.integrations.vllm import KVMoveConnector
from kvmove.integrations.vllm.stats import KVMoveConnectorStats, KVMovePromMetrics, StatsSince


def test_a_movers_interval_becomes_stats_that_reach_prometheus(store):
    row, blocks, layers = 8192, 4, 3
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (layers, 16, row), dtype=torch.uint8)})
    since = StatsSince()
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=8, raw_keys=True,
                        path="staged") as mover:
        assert since.take(mover) is None  # nothing moved yet
        keys = [f"{uuid.uuid4().hex}@{i}" for i in range(blocks)]
        assert mover.evict(keys, torch.arange(blocks).reshape(-1, 1)).wait(30) == [
            kvmove.Status.OK] * blocks
        first = since.take(mover)
        got = mover.prefetch([*keys, "absent"], torch.arange(8, 8 + blocks + 1).reshape(
            -1, 1)).wait(30)
        second = since.take(mover)
    assert got == [kvmove.Status.OK] * blocks + [kvmove.Status.MISS]
    assert first.data["store_bytes"] == blocks * row * layers and first.data["load_bytes"] == 0
    assert first.data["store_time"] > 0 and first.data["keys"] == {"OK": blocks}
    assert second.data["load_bytes"] == blocks * row * layers
    assert second.data["store_bytes"] == 0 and second.data["load_time"] > 0
    assert second.data["keys"] == {"OK": blocks, "MISS": 1}
    # what vLLM's scheduler does with the workers' stats: rebuild, aggregate, reduce
    total = KVMoveConnector.build_kv_connector_stats(dict(first.data))
    total = total.aggregate(KVMoveConnector.build_kv_connector_stats(second.data))
    reduced = total.reduce()
    assert reduced["store_bytes"] == reduced["load_bytes"] == blocks * row * layers
    assert reduced["keys:OK"] == 2 * blocks and reduced["keys:MISS"] == 1
    assert reduced["load_GBps"] == round(blocks * row * layers / reduced["load_time"] / 1e9, 3)
    registry = prometheus_client.CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (
        prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)}
    prom = KVMovePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                             {0: ["0"]})
    prom.observe(total.data, engine_idx=0)
    sample = partial(registry.get_sample_value, labels={"engine": "0"})
    assert sample("vllm:kv_offload_store_bytes_total") == blocks * row * layers
    assert sample("vllm:kv_offload_load_time_total") == total.data["load_time"]
    assert registry.get_sample_value("vllm:kvmove_keys_total",
                                     {"engine": "0", "status": "MISS"}) == 1


def test_empty_stats_are_empty():
    assert KVMoveConnectorStats().is_empty()
    assert KVMoveConnector.build_kv_connector_stats(None).is_empty()
