"""Launching a compiled Triton kernel again without Triton's per-call work.

``kernel[grid](...)`` binds, specialises, hashes and looks the kernel up on every call: tens
of µs of host time per launch. A launcher that knows what its kernel specialises on keys
the compiled kernel by a tuple of its own and launches it as ``JITFunction.run`` does (the
same code, the same arguments). The first launch of each key goes through Triton. Triton's
own path is kept whenever a launch, pre-run or stage-inspection hook is set, on the
interpreter, on Triton versions outside :data:`CHECKED`, and when
``KVMOVE_TRITON_FAST_LAUNCH=0``.
"""

from __future__ import annotations

import os
import re
import threading

import triton
from triton.runtime import driver

try:  # Triton >= 3.4; before it, every launch goes through Triton
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton
    knobs = None

ENV = "KVMOVE_TRITON_FAST_LAUNCH"
MAX_KEYS = 512  # compiled kernels kept per launcher (then the table starts again)
# Triton versions [from, to) whose run() launches as below (checked: 3.5, 3.6 and 3.9). The
# options Triton reads at each launch (debug, instrumentation) are part of the key.
CHECKED = ((3, 5), (3, 10))


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string; (0, 0) when it has none."""
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (0, 0)


class CompiledLaunches:
    """Launches of one ``@triton.jit`` function, keyed by its caller.

    ``key`` must differ wherever Triton's specialisation could differ: the dtype and
    16-byte alignment of each pointer it specialises on (the dtype alone for those in
    ``do_not_specialize``), the value (or, for ``do_not_specialize``, the 32/64-bit width)
    of each integer, every constexpr, the launch options, and the device."""

    def __init__(self, fn, names: tuple[str, ...], num_positional: int):
        self.fn = fn
        self.names = names  # every parameter, in order
        self.num_positional = num_positional  # those given positionally to Triton's launch
        self._kernels: dict = {}
        self._lock = threading.Lock()
        self.enabled = (knobs is not None and os.environ.get(ENV, "1") != "0"
                        and CHECKED[0] <= _version(triton.__version__) < CHECKED[1])
        self._stream = None

    def launch(self, key: tuple, grid: int, args: tuple, device_index: int,
               num_warps: int) -> None:
        """Launch ``fn`` on ``grid`` programs with ``args`` (every parameter, in order) on
        the current stream of device ``device_index``."""
        if not self.enabled:
            self.through_triton(self.fn, grid, args, num_warps)
            return
        key = (key, *_options())
        kernel = self._kernels.get(key)
        if kernel is None or self._hooked():
            self._launch_and_keep(key, grid, args, num_warps)
            return
        if self._stream is None:
            self._stream = driver.active.get_current_stream
        kernel.run(grid, 1, 1, self._stream(device_index), kernel.function,
                   kernel.packed_metadata, None, None, None, *args)

    def through_triton(self, fn, grid: int, args: tuple, num_warps: int):
        """``fn[grid](...)`` (``fn``: this launcher's function, or its interpreted twin) with
        ``args`` split into Triton's positional arguments and constexpr keywords; returns
        what Triton returns (the compiled kernel, on a GPU)."""
        n = self.num_positional
        return fn[(grid,)](*args[:n], **dict(zip(self.names[n:], args[n:], strict=True)),
                           num_warps=num_warps)

    def _hooked(self) -> bool:
        """Whether something watches Triton's launches: they must go through Triton."""
        runtime = knobs.runtime
        return (bool(self.fn.pre_run_hooks) or _hooked(runtime.launch_enter_hook)
                or _hooked(runtime.launch_exit_hook)
                or getattr(runtime, "add_stages_inspection_hook", None) is not None)

    def _launch_and_keep(self, key: tuple, grid: int, args: tuple, num_warps: int) -> None:
        kernel = self.through_triton(self.fn, grid, args, num_warps)
        if not hasattr(kernel, "packed_metadata"):  # the interpreter
            return
        with self._lock:
            if len(self._kernels) >= MAX_KEYS:
                self._kernels.clear()
            self._kernels[key] = kernel


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton's hooks are chains, empty unless one was added."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _options() -> tuple:
    """The compile options Triton's ``run`` reads from its knobs at each launch."""
    compilation = knobs.compilation
    return (knobs.runtime.debug, getattr(compilation, "instrumentation_mode", None),
            getattr(compilation, "fpsan_homomorphic_casts", None))
