"""The row-copy kernel compiles for NVIDIA GPUs with the installed Triton, on a machine
without one: every specialisation a launch can ask for (each row-size class's default
config and the corners of the tuner's search space, over word sizes, alignments, index
dtypes and error counting) goes through Triton's whole NVIDIA pipeline (TTIR, TTGIR, LLVM,
PTX, ``ptxas``) for Hopper (sm_90) and Ampere (sm_80).

The interpreter, which runs every other kernel test here, checks what the kernel does, not
whether the compiler takes it: Triton 3.6 once refused a kernel the interpreter and Triton
3.5 and 3.9 ran (a layout pass failed on a ``tl.where`` feeding both a load and a store).
``scripts/test_triton_versions.sh`` runs this file again under the Triton versions engines
ship with (``KVMOVE_EXPECT_TRITON`` names the version the run must see).
"""

from __future__ import annotations

import os

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvmove.kernels import row_copy
from kvmove.kernels.configs import DEFAULTS, LaunchConfig

TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)]
# (row bytes, pitch, base alignment): every word size and vector width launch_constants picks
GEOMETRIES = [(4, 4, 4), (132, 132, 4), (576, 576, 16), (656, 656, 16), (1152, 1152, 16),
              (4100, 4100, 4), (8192, 8192, 16), (6, 6, 2), (3, 3, 1), (656, 672, 16)]
# The corners of the tuner's space (kvmove.tuning.config_search), on two geometries.
CORNERS = [LaunchConfig(block_bytes=b, rows=r, num_warps=w, max_programs=16)
           for b, r in ((128, 1), (128, 64), (1024, 64), (8192, 1), (8192, 8)) for w in (1, 16)]
CORNER_GEOMETRIES = [(656, 656, 16), (3, 3, 1)]
ARG_TYPES = {"src_table": "*i64", "dst_table": "*i64", "errors": "*i32", "n": "i32",
             "src_limit": "i32", "dst_limit": "i32", "src_pitch": "i32", "dst_pitch": "i32",
             "row_words": "i32", "num_row_blocks": "i32", "num_items": "i32"}
ALIGNED = ("src_table", "dst_table", "src_limit", "dst_limit", "src_pitch", "dst_pitch",
           "row_words")  # the arguments Triton may see as multiples of 16


def specialisations() -> list[tuple[dict, int]]:
    """Distinct (constexprs, num_warps) pairs of the launches above."""
    seen, out = set(), []
    plan = [(c, GEOMETRIES) for c in DEFAULTS.values()] + [(c, CORNER_GEOMETRIES)
                                                           for c in CORNERS]
    for config, geometries in plan:
        for row_bytes, pitch, alignment in geometries:
            const = row_copy.launch_constants(row_bytes, pitch, pitch, alignment, config)
            for count in (True, False):
                key = (tuple(sorted((k, str(v)) for k, v in const.items())), count,
                       config.num_warps)
                if key not in seen:
                    seen.add(key)
                    out.append(({**const, "COUNT_ERRORS": count}, config.num_warps))
    return out


def compile_for(target: GPUTarget, const: dict, num_warps: int, index_type: str,
                aligned: bool) -> None:
    kernel = row_copy._copy_rows_kernel
    names = kernel.arg_names
    types = {**ARG_TYPES, "src_rows": index_type, "dst_rows": index_type}
    signature = {n: "constexpr" if n in const else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED} if aligned else {}
    triton.compile(ASTSource(kernel, signature, const, attrs), target=target,
                   options={"num_warps": num_warps, "enable_fp_fusion": False})


def test_the_run_sees_the_expected_triton():
    expected = os.environ.get("KVMOVE_EXPECT_TRITON")
    if expected:
        assert triton.__version__ == expected, (triton.__version__, triton.__file__)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
def test_every_specialisation_compiles(target):
    failed = []
    cases = specialisations()
    assert len(cases) > 20  # the list above is not empty by mistake
    for i, (const, warps) in enumerate(cases):
        index_type = ("*i32", "*i64")[i % 2]
        aligned = i % 3 != 0
        try:
            compile_for(target, const, warps, index_type, aligned)
        except Exception as e:  # every failure, not the first only
            failed.append(f"{const} num_warps={warps} rows {index_type} aligned={aligned}: "
                          f"{type(e).__name__}: {str(e)[:200]}")
    assert not failed, f"Triton {triton.__version__}, sm_{target.arch}:\n" + "\n".join(failed)
