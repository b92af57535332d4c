"""Shared fixtures: one embedded Mooncake store for the whole session, unique key prefixes."""

from __future__ import annotations

import uuid

import pytest

import kvmove

LEASE_MS = 1000  # the shared store's read lease (Mooncake's default is 10 s)


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
    from tests.interpreter_check import interpreter_problem

    callspec = getattr(request.node, "callspec", None)
    runs_kernel = request.node.get_closest_marker("interpreter") is not None or (
        callspec is not None and callspec.params.get("backend") == "triton")
    if runs_kernel and (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
