"""A direct send (``PageSender`` into a receiver in another process), metrics on: the bytes
that landed are exported under ``direction="send"`` (gather and send stages), with the
call's host time; the receiver holds exactly those bytes. Failover: the counter the store's
replica failover records into."""

from __future__ import annotations

import torch

from kvmove import Status
from kvmove.metrics import record
from tests.direct.conftest import HYBRID, PAGE_TOKENS


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_a_send_exports_the_bytes_that_landed(registry, receivers, sender, kv_bytes):
    rx = receivers["layer_first"]
    pages = torch.arange(3 * PAGE_TOKENS).reshape(3, PAGE_TOKENS)
    expected = rx.expect(kv_bytes, pages, [5, 6, 7])
    assert sender.send(rx.handle, pages, [5, 6, 7]).wait(30) == [Status.OK] * 3
    rx.assert_holds(expected)
    page_bytes = PAGE_TOKENS * sum(layers * row for layers, row in HYBRID.values())
    for stage in ("gather", "send"):
        assert value(registry, "kvmove_bytes_total", direction="send", stage=stage) == (
            3 * page_bytes)
        assert value(registry, "kvmove_stage_seconds_total", direction="send",
                     stage=stage) > 0
    assert value(registry, "kvmove_keys_total", direction="send", status="OK", code="OK") == 3
    assert value(registry, "kvmove_call_host_seconds_count", op="send") == 1


def test_failovers_are_counted(registry):
    record.failover(4, 3)
    record.failover(2, 0)
    assert value(registry, "kvmove_failover_keys_total", outcome="tried") == 6
    assert value(registry, "kvmove_failover_keys_total", outcome="recovered") == 3
