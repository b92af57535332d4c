"""The copy engine's batching and its fallback, at the binding boundary: a fake of
:mod:`kvmove.memory.cuda_api` that records every enqueued span and refuses chosen batches. A
refused batch is copied span by span in that call only, and no span is enqueued twice. Also:
kvmove imports its CUDA bindings only when a CUDA copy needs them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvmove.memory import cuda_api
from kvmove.rows.copy_engine import span_copies as copy_engine
from kvmove.rows.copy_engine.span_copies import MAX_BATCH, CudaCopier


class FakeApi:
    """Records enqueued spans; refuses the batch calls whose ordinal is in ``refuse``."""

    def __init__(self, refuse=(), fail_index=3):
        self.refuse = set(refuse)
        self.fail_index = fail_index
        self.batch_calls = 0
        self.enqueued: list[tuple[int, int, int]] = []
        self.kinds: list[str] = []

    def has_memcpy_batch(self) -> bool:
        return True

    def memcpy_batch(self, dsts, srcs, sizes, stream, *, device, src_location, dst_location):
        ordinal = self.batch_calls
        self.batch_calls += 1
        assert len(dsts) <= MAX_BATCH and stream == 7 and device == 0
        if ordinal in self.refuse:
            raise cuda_api.BatchRefused("cuMemcpyBatchAsync failed: CUDA error 1", 1,
                                        self.fail_index)
        self.enqueued += zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True)
        self.kinds.append("batch")

    def memcpy_async(self, dst, src, nbytes, stream):
        assert stream == 7
        self.enqueued.append((dst, src, nbytes))
        self.kinds.append("span")

    def memcpy_2d_async(self, *args):
        raise AssertionError("no 2-D copies here")


def spans(n):
    i = np.arange(n, dtype=np.int64)
    return i * 64 + (1 << 20), i * 32 + (1 << 30), i % 5 + 1


def copy(api, n):
    dsts, srcs, sizes = spans(n)
    calls = CudaCopier(api).batched(dsts, srcs, sizes, 7, device=0,
                                    src_location=(cuda_api.LOCATION_DEVICE, 0),
                                    dst_location=(cuda_api.LOCATION_HOST, 0))
    expect = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True))
    return calls, expect


@pytest.mark.parametrize("n", [1, 5, MAX_BATCH, MAX_BATCH + 1, 3 * MAX_BATCH + 17])
def test_batches_cover_every_span_once(n):
    api = FakeApi()
    calls, expect = copy(api, n)
    assert calls == -(-n // MAX_BATCH) == api.batch_calls
    assert api.enqueued == expect


@pytest.mark.parametrize("refused", [0, 1, 2])
def test_a_refused_batch_falls_back_from_there_without_repeating_a_span(refused):
    n = 2 * MAX_BATCH + 100  # three batches
    api = FakeApi(refuse={refused})
    calls, expect = copy(api, n)
    assert sorted(api.enqueued) == sorted(expect), "a span was lost or enqueued twice"
    assert len(set(api.enqueued)) == len(api.enqueued) == n
    assert api.kinds[:refused] == ["batch"] * refused
    assert api.kinds[refused:] == ["span"] * (n - refused * MAX_BATCH)
    assert calls == refused + n - refused * MAX_BATCH
    assert api.batch_calls == refused + 1  # nothing after the refusal was batched in this call


def test_a_refusal_affects_its_call_only():
    api = FakeApi(refuse={0})
    copier = CudaCopier(api)
    dsts, srcs, sizes = spans(10)
    args = dict(device=0, src_location=(1, 0), dst_location=(2, 0))
    assert copier.batched(dsts, srcs, sizes, 7, **args) == 10  # span by span
    assert copier.batched(dsts, srcs, sizes, 7, **args) == 1  # the next call batches again
    assert copier.batch_failures == 1 and copier.has_batch
    assert api.kinds == ["span"] * 10 + ["batch"]


def test_other_errors_are_not_swallowed():
    class Broken(FakeApi):
        def memcpy_batch(self, *a, **k):
            raise cuda_api.CudaApiError("cuMemcpyBatchAsync is not available here")

    with pytest.raises(cuda_api.CudaApiError, match="not available"):
        copy(Broken(), 3)


def test_the_process_wide_copier_uses_the_bindings_module():
    assert copy_engine.cuda_copier().api is cuda_api


def test_only_cuda_api_imports_the_bindings_and_only_when_called():
    import ast
    from pathlib import Path

    root = Path(cuda_api.__file__).parents[1]  # the whole kvmove package
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            binding = [n for n in names if n.split(".")[0] in ("cupy", "cupy_backends")
                       or n.startswith("cuda.")]
            if not binding:
                continue
            assert path.name == "cuda_api.py", f"{path} imports {binding}"
            assert node not in tree.body, f"{path} imports {binding} at import time"
    code = ("import sys, kvmove, kvmove.memory.cuda_api; "
            "print('cupy' in sys.modules or 'cuda.bindings' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "False"


@pytest.fixture
def without_cuda_bindings(monkeypatch):
    """``import cuda.bindings`` fails (as on a machine without the package)."""
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    for f in (cuda_api._bindings, cuda_api._batch):
        f.cache_clear()
    yield
    for f in (cuda_api._bindings, cuda_api._batch):
        f.cache_clear()


def test_without_cuda_bindings_a_copy_engine_call_is_a_clear_error(without_cuda_bindings):
    with pytest.raises(cuda_api.CudaApiError, match=r"kvmove\[cuda\d+\]"):
        cuda_api.memcpy_async(1, 2, 3, 0)
    with pytest.raises(cuda_api.CudaApiError, match="cuda-bindings"):
        cuda_api.memcpy_2d_async(1, 8, 2, 8, 4, 2, 0)
    assert "cuda-bindings" in cuda_api.copy_engine_problem()
    assert not cuda_api.has_memcpy_batch()


def test_pinning_needs_no_binding_the_device_address_is_the_host_address(
        without_cuda_bindings, monkeypatch):
    """Unified addressing: without cuda-bindings (and without cupy) the device address of
    registered mapped memory is its host address, and registering needs nothing but
    torch's runtime (no cupy)."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert cuda_api.device_pointer(0x7F00_1234_5000) == 0x7F00_1234_5000


def test_with_cuda_bindings_the_device_address_is_asked_of_the_runtime(monkeypatch):
    asked = []

    class Runtime:
        @staticmethod
        def cudaHostGetDevicePointer(address, flags):
            asked.append((address, flags))
            return 0, address + 0x1000  # a system where the two differ

    monkeypatch.setattr(cuda_api, "_bindings", lambda: (Runtime, None))
    assert cuda_api.device_pointer(0x5000) == 0x6000
    assert asked == [(0x5000, 0)]
    assert cuda_api.copy_engine_problem() is None
