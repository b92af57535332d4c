"""Whether this machine's Triton interpreter can run a kernel that loops over a range of
program ids (as ``kernels/row_copy.py`` does). Triton 3.6 and older call ``int()`` on a
one-element array there, which numpy 2.4 refuses (triton-lang/triton#9171, fixed after
3.6): the interpreter tests are then skipped with that reason instead of failing."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _strided_loop_kernel(out_ptr, n):
    pid = tl.program_id(0)
    for i in range(pid, n, tl.num_programs(0)):
        tl.store(out_ptr + i, i + 1)


@functools.cache
def interpreter_problem() -> str | None:
    """None when the interpreter runs the probe kernel right; else why it cannot. Only the
    known numpy incompatibility is reported: any other failure is raised."""
    out = torch.zeros(5, dtype=torch.int32)
    try:
        InterpretedFunction(_strided_loop_kernel.fn)[(2,)](out, 5)
    except Exception as e:  # the interpreter wraps the TypeError in its own error
        if "0-dimensional arrays" not in str(e):
            raise
        import numpy

        return (f"Triton {triton.__version__}'s interpreter fails with numpy "
                f"{numpy.__version__} (triton-lang/triton#9171: fixed after Triton 3.6; "
                "use numpy<2.4 with it)")
    if out.tolist() != [1, 2, 3, 4, 5]:
        raise AssertionError(f"the Triton interpreter wrote {out.tolist()}, not [1, 2, 3, 4, 5]")
    return None
