"""Metrics on for one test, exported through a registry of its own; the direct transfer's
fixtures (a receiver process, a sender) for the send test."""

from __future__ import annotations

import pytest

from tests.direct.conftest import kv_bytes, peers, receivers, sender  # noqa: F401 (fixtures)

prometheus_client = pytest.importorskip("prometheus_client")


@pytest.fixture
def registry():
    """A fresh ``CollectorRegistry`` kvmove's metrics are enabled on, disabled after."""
    from kvmove import metrics

    reg = prometheus_client.CollectorRegistry()
    metrics.enable(reg)
    yield reg
    metrics.disable()
