"""The row-copy kernel compiles for a Hopper GPU (sm_90) on this machine without one — the
Triton front end, the MLIR passes and ptxas from the Triton wheel all run on the CPU — and
aligned rows get 16-byte vector loads and stores (the accesses that keep many bytes in
flight over PCIe). Catches a kernel that only works in the interpreter."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from kvmove.kernels.row_copy import _copy_rows_kernel

pytest.importorskip("triton.backends.nvidia")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

SIGNATURE = {
    "src_table": "*i64", "dst_table": "*i64", "src_rows": "*i32", "dst_rows": "*i64",
    "errors": "*i32", "n": "i32", "src_limit": "i32", "dst_limit": "i32", "src_pitch": "i32",
    "dst_pitch": "i32", "row_words": "i32", "num_row_blocks": "i32", "num_items": "i32",
    "WORD": "constexpr", "VEC": "constexpr", "ALIGN": "constexpr", "ROWS": "constexpr",
    "BLOCK": "constexpr", "COUNT_ERRORS": "constexpr",
}


def ptx_for(word, vec: int, word_bytes: int) -> str:
    fn = _copy_rows_kernel
    if isinstance(fn, InterpretedFunction):  # TRITON_INTERPRET=1 was set when it was made
        fn = JITFunction(fn.fn)
    constants = {"WORD": word, "VEC": vec, "ALIGN": vec * word_bytes, "ROWS": 8,
                 "BLOCK": 256, "COUNT_ERRORS": True}
    # Pointer arguments are 16-byte aligned, as the launcher's tensors are.
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, kind in enumerate(SIGNATURE.values()) if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=SIGNATURE, attrs=attrs, constexprs={
        (fn.arg_names.index(name),): value for name, value in constants.items()})
    try:
        # No floating point in the kernel: fusing multiply-adds changes nothing.
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"enable_fp_fusion": False})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton build
        if "ptxas" in str(e):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    return kernel.asm["ptx"]


def test_aligned_rows_use_16_byte_vector_accesses():
    ptx = ptx_for(tl.int32, 4, 4)  # e.g. 656-byte rows in 16-byte aligned layers
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.parametrize(("word", "word_bytes"), [(tl.int32, 4), (tl.int16, 2), (tl.int8, 1)])
def test_unaligned_rows_compile_with_narrow_words(word, word_bytes):
    ptx = ptx_for(word, 1, word_bytes)
    assert "atom.global" in ptx or "red.global" in ptx  # the error counter
    assert "st.global" in ptx
