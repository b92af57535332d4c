"""CompiledLaunches (no GPU needed: a stand-in for Triton's JIT function and compiled
kernel): the first launch of a key goes through Triton, later ones straight to the
compiled kernel with every argument in order; a launch or pre-run hook, a Triton version
not checked, or the kill switch keeps Triton's path; a debug launch is another kernel; the
row-copy launcher's parameter list matches its kernel. (The row-copy key against Triton's
own specialisation: tests/kernels/test_row_copy_compile.py.)"""

from __future__ import annotations

import inspect

import pytest

from kvmove.kernels import compiled_launch
from kvmove.kernels.compiled_launch import CompiledLaunches


class FakeCompiled:
    packed_metadata = "meta"
    function = "fn-handle"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJit:
    def __init__(self):
        self.calls = []
        self.compiled = {}
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            self.calls.append((grid, args, constexprs, num_warps))
            return self.compiled.setdefault(tuple(constexprs.items()), FakeCompiled())
        return launch


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.delenv(compiled_launch.ENV, raising=False)
    fn = FakeJit()
    out = CompiledLaunches(fn, ("a", "b", "K"), 2)
    out._stream = lambda device: f"stream-{device}"
    return fn, out


def test_the_first_launch_of_a_key_goes_through_triton_the_next_straight(launches):
    fn, out = launches
    out.launch(("k", 1), 5, (10, 20, 3), 0, 4)
    assert fn.calls == [((5,), (10, 20), {"K": 3}, 4)]
    compiled = fn.compiled[(("K", 3),)]
    out.launch(("k", 1), 7, (11, 21, 3), 1, 4)
    assert len(fn.calls) == 1
    assert compiled.runs == [(7, 1, 1, "stream-1", "fn-handle", "meta", None, None, None,
                              11, 21, 3)]
    out.launch(("k", 2), 7, (11, 21, 4), 0, 4)  # another key: through Triton again
    assert len(fn.calls) == 2


def test_a_launch_hook_keeps_tritons_path(launches, monkeypatch):
    from triton import knobs

    fn, out = launches
    out.launch(("k",), 1, (1, 2, 3), 0, 4)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        out.launch(("k",), 1, (1, 2, 3), 0, 4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(fn.calls) == 2
    assert not fn.compiled[(("K", 3),)].runs
    out.launch(("k",), 1, (1, 2, 3), 0, 4)  # the hook is gone: straight again
    assert len(fn.calls) == 2


def test_a_pre_run_hook_keeps_tritons_path(launches):
    fn, out = launches
    out.launch(("k",), 1, (1, 2, 3), 0, 4)
    fn.pre_run_hooks.append(lambda *a, **k: None)
    out.launch(("k",), 1, (1, 2, 3), 0, 4)
    assert len(fn.calls) == 2


def test_a_debug_launch_is_another_kernel(launches, monkeypatch):
    from triton import knobs

    fn, out = launches
    out.launch(("k",), 1, (1, 2, 3), 0, 4)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    out.launch(("k",), 1, (1, 2, 3), 0, 4)
    assert len(fn.calls) == 2  # Triton's run compiles a debug kernel: not the one kept


@pytest.mark.parametrize(("version", "taken"), [("3.4.0", False), ("3.5.1", True),
                                                ("3.6.0+git1a2b", True), ("3.9.0", True),
                                                ("3.10.0", False), ("4.0.0", False)])
def test_only_checked_triton_versions_take_the_direct_launch(monkeypatch, version, taken):
    monkeypatch.delenv(compiled_launch.ENV, raising=False)
    monkeypatch.setattr(compiled_launch.triton, "__version__", version)
    assert CompiledLaunches(FakeJit(), ("a",), 1).enabled is taken


def test_the_kill_switch_keeps_tritons_path(monkeypatch):
    monkeypatch.setenv(compiled_launch.ENV, "0")
    fn = FakeJit()
    out = CompiledLaunches(fn, ("a", "b", "K"), 2)
    for _ in range(3):
        out.launch(("k",), 1, (1, 2, 3), 0, 4)
    assert len(fn.calls) == 3


def test_the_row_copy_launcher_lists_its_kernels_parameters_in_order():
    from kvmove.kernels import row_copy

    fn = row_copy._copy_rows_kernel.fn  # the Python function, compiled or interpreted
    params = list(inspect.signature(fn).parameters.values())
    assert tuple(p.name for p in params) == row_copy._PARAMS
    constexprs = [p.name for p in params if "constexpr" in str(p.annotation)]
    assert constexprs == list(row_copy._PARAMS[row_copy._POSITIONAL:])
