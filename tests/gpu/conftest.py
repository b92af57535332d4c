"""The GPU tests (``scripts/gpu_check.sh`` runs them; skipped without a CUDA GPU): the real
Triton compiler, never the interpreter; a private tuning cache; an in-memory store for the
mover (:mod:`tests.support.memory_store`), so that no mover test is skipped on a GPU machine
without Mooncake's CUDA wheel; and no copy-engine batch refused by the driver in any test
(the copies would still be right, span by span, and hide it)."""

from __future__ import annotations

import pytest
import torch

from tests.support.memory_store import MemoryStore


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    two = pytest.mark.skip(reason="needs two GPUs")
    for item in items:
        if not str(item.path).startswith(here):
            continue
        if not torch.cuda.is_available():
            item.add_marker(skip)
        elif item.get_closest_marker("multi_gpu") and torch.cuda.device_count() < 2:
            item.add_marker(two)


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch, tmp_path):
    """The real Triton compiler (never the interpreter), a private tuning cache."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVMOVE_AUTOTUNE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from kvmove.rows import launch_config

    launch_config.reset()
    yield
    launch_config.reset()


@pytest.fixture(autouse=True)
def no_refused_batch():
    """A batch ``cuMemcpyBatchAsync`` refused falls back to one copy per span: right bytes,
    lost speed. On the GPU machine that is a failure of the test that caused it."""
    from kvmove.rows.copy_engine.span_copies import cuda_copier

    before = cuda_copier().batch_failures
    yield
    refused = cuda_copier().batch_failures - before
    assert refused == 0, f"the driver refused {refused} copy-engine batch(es) (see the log)"


@pytest.fixture
def gpu_store():
    """A store for the mover's GPU tests: in memory (same statuses as MooncakeStore)."""
    with MemoryStore() as store:
        yield store
