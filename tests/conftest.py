"""Shared fixtures: one embedded Mooncake store for the whole session, unique key prefixes,
the Triton interpreter per test. The engine integration tests (``integrations/sglang``,
``integrations/vllm``) run in their engines' own environments, each as its own stage
(``scripts/test_sglang.sh``, ``scripts/test_vllm.sh`` set ``KVMOVE_ENGINE_STAGE``); the
core run leaves them out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import kvmove
from kvmove.store.embedded_master import free_ports, tcp_reachable

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
    Triton interpreter cannot run kernels (``tests/support/interpreter.py``), the tests that
    run one are skipped with the reason: those marked ``interpreter`` and those whose ``backend``
    parameter is ``"triton"``. Torch-backend tests still run."""
    from tests.support.interpreter import interpreter_problem

    callspec = getattr(request.node, "callspec", None)
    runs_kernel = request.node.get_closest_marker("interpreter") is not None or (
        callspec is not None and callspec.params.get("backend") == "triton")
    if runs_kernel and (problem := interpreter_problem()) is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def metadata_server_binary() -> str | None:
    beside = Path(sys.executable).with_name("mooncake_http_metadata_server")
    return str(beside) if beside.exists() else shutil.which("mooncake_http_metadata_server")


@pytest.fixture
def metadata_server(monkeypatch):
    """Mooncake's own HTTP metadata server on a free loopback port, set as this test's
    ``MOONCAKE_TE_META_DATA_SERVER`` (over TCP; processes started meanwhile inherit it)."""
    binary = metadata_server_binary()
    if binary is None:
        pytest.skip("Mooncake's mooncake_http_metadata_server is not installed")
    port = free_ports("127.0.0.1", 1)[0]
    proc = subprocess.Popen([binary, f"--port={port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not tcp_reachable("127.0.0.1", port, 0.5):
            assert proc.poll() is None and time.monotonic() < deadline, \
                "the metadata server did not start"
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/metadata"
        monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", url)
        monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
