"""Shared fixtures: one embedded Mooncake store for the whole session, unique key prefixes,
the Triton interpreter per test. The engine integration tests (``integrations/sglang``,
``integrations/vllm``) run in their engines' own environments, each as its own stage
(``scripts/test_sglang.sh``, ``scripts/test_vllm.sh`` set ``KVMOVE_ENGINE_STAGE``); the
core run leaves them out."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

import kvmove

LEASE_MS = 1000  # the shared store's read lease (Mooncake's default is 10 s)
ENGINE_STAGES = {Path(__file__).parent / "integrations" / name: name
                 for name in ("sglang", "vllm")}


def pytest_ignore_collect(collection_path, config):
    """Collect an engine's tests only in that engine's stage."""
    stage = ENGINE_STAGES.get(Path(collection_path))
    if stage is not None and os.environ.get("KVMOVE_ENGINE_STAGE") != stage:
        return True
    return None


@pytest.fixture(scope="session")
def store():
    """One embedded store (private mooncake_master on loopback, TCP) for the session. Tests
    share it, so each uses its own keys (see ``keyspace``)."""
    s = kvmove.MooncakeStore.embedded(kv_lease_ttl_ms=LEASE_MS)
    yield s
    s.close()


@pytest.fixture
def keyspace():
    """A function ``keyspace(n) -> list[str]`` of ``n`` keys unique to this test."""
    prefix = uuid.uuid4().hex[:12]
    return lambda n, tag="k": [f"{prefix}/{tag}{i}" for i in range(n)]


@pytest.fixture
def triton_interpreter(request, monkeypatch):
    """Kernels run on the CPU through the Triton interpreter: set per test, never globally
    (``pytestmark = pytest.mark.usefixtures("triton_interpreter")``). Where this machine's
    Triton interpreter cannot run kernels (see ``interpreter_check``), the tests that run one
    are skipped with the reason: those marked ``interpreter`` and those whose ``backend``
    parameter is ``"triton"``. Torch-backend tests still run."""
    from tests.support.interpreter import interpreter_problem

    callspec = getattr(request.node, "callspec", None)
    runs_kernel = request.node.get_closest_marker("interpreter") is not None or (
        callspec is not None and callspec.params.get("backend") == "triton")
    if runs_kernel and (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
