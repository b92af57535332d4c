"""``kvmove doctor``'s look at the copy engine's binding: on a GPU machine
a missing cuda-bindings is a note (pinned staging and the direct kernel need no binding),
a problem where the copy engine is required (``--gpu-check``, what ``scripts/gpu_check.sh``
stops on, with the fix named); a binding of another CUDA major than torch's is a note (it
works where the driver supports both: on a GPU the doctor's probe copy tells)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvmove.cli import doctor
from kvmove.memory import cuda_api


@pytest.fixture(autouse=True)
def fresh_bindings():
    """The binding lookup is cached: each test (and what follows it) looks again."""
    cuda_api._bindings.cache_clear()
    yield
    cuda_api._bindings.cache_clear()


def test_a_missing_binding_is_a_note_or_a_problem_when_required(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    [note] = doctor.check_cuda_bindings("NVIDIA H200")
    assert note.level == "note" and "direct kernel need no binding" in note.text
    [problem] = doctor.check_cuda_bindings("NVIDIA H200", required=True)
    assert problem.level == "problem" and "kvmove[cuda13]" in problem.fix
    assert doctor.check_cuda_bindings(None, required=True)[0].level == "note"  # no GPU


def test_a_binding_of_another_cuda_major_is_a_note(monkeypatch):
    package = types.ModuleType("cuda.bindings")
    package.driver = types.ModuleType("cuda.bindings.driver")
    package.runtime = types.ModuleType("cuda.bindings.runtime")
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", package.driver)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", package.runtime)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(doctor, "_version", lambda dist: "12.9.4")
    found = doctor.check_cuda_bindings("NVIDIA H200", required=True)
    assert [f.level for f in found] == ["ok", "note"]  # no GPU here: no probe copy
    assert "for CUDA 12" in found[1].text and "cuda-bindings>=13,<14" in found[1].fix
    monkeypatch.setattr(doctor, "_version", lambda dist: "13.5.0")
    found = doctor.check_cuda_bindings("NVIDIA H200", required=True)
    assert all(f.level != "problem" for f in found)
