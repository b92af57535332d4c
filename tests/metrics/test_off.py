"""Metrics are off unless asked: the hooks record nothing and export nothing, and a mover
works the same."""

from __future__ import annotations

import pytest
import torch

import kvmove
from kvmove import metrics
from kvmove.metrics import record


def test_off_by_default_nothing_recorded(store, keyspace):
    assert not metrics.enabled() and record._tallies is None
    assert record.clock() == 0
    kv = kvmove.KVCache({"kv": torch.randint(0, 255, (2, 32, 132), dtype=torch.uint8)})
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="staged") as mover:
        assert mover.evict(keyspace(1), torch.arange(4).reshape(1, 4)).wait(30) == [
            kvmove.Status.OK]
    assert record._tallies is None


def test_enable_twice_is_one_tallies_and_disable_unregisters():
    import prometheus_client

    reg = prometheus_client.CollectorRegistry()
    try:
        assert metrics.enable(reg) is metrics.enable(reg)
        assert reg.get_sample_value("kvmove_staging_slots") == 0
    finally:
        metrics.disable()
    assert reg.get_sample_value("kvmove_staging_slots") is None
    assert not metrics.enabled()


@pytest.mark.parametrize("value", [-1, 65536, "80", True, 1.5])
def test_serve_refuses_a_bad_port_naming_it(value):
    with pytest.raises(ValueError, match="port"):
        metrics.serve(value)
    assert not metrics.enabled()


def test_env_port_must_be_a_number():
    with pytest.raises(ValueError, match=r"KVMOVE_METRICS_PORT.*'x'"):
        metrics.enable_from_env({"KVMOVE_METRICS_PORT": "x"})
    assert metrics.enable_from_env({}) is None
