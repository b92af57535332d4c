"""The row-copy kernel compiles for a Hopper GPU (sm_90) on this machine without one — the
Triton front end, the MLIR passes and ptxas from the Triton wheel all run on the CPU — and
aligned rows get 16-byte vector loads and stores (the accesses that keep many bytes in
flight over PCIe). Catches a kernel that only works in the interpreter. Every specialisation
the default launch configs produce compiles (each row class, aligned and odd rows, with and
without the error counter, int32 and int64 indices), and the per-call scalars ``n``,
``num_row_blocks`` and ``num_items`` never select a new specialisation."""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton
import triton.language as tl

from kvmove.kernels.configs import DEFAULTS, LaunchConfig, default_config, row_class
from kvmove.kernels.row_copy import (
    _copy_rows_kernel,
    kernel_constants,
    launch_constants,
    spans_apply,
)

pytest.importorskip("triton.backends.nvidia")
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

SIGNATURE = {
    "src_table": "*i64", "dst_table": "*i64", "src_rows": "*i32", "dst_rows": "*i64",
    "errors": "*i32", "n": "i32", "src_limit": "i32", "dst_limit": "i32", "src_pitch": "i32",
    "dst_pitch": "i32", "row_words": "i32", "num_row_blocks": "i32", "num_items": "i32",
    "num_layers": "i32", "span_vecs": "i32", "span_layers": "i32", "WORD": "constexpr",
    "VEC": "constexpr", "ALIGN": "constexpr", "ROWS": "constexpr", "BLOCK": "constexpr",
    "COUNT_ERRORS": "constexpr", "SRC_PAGE": "constexpr",
    "DST_PAGE": "constexpr", "SPAN_WORD": "constexpr", "SPAN_VEC": "constexpr",
    "SPAN_ALIGN": "constexpr", "SPAN_BLOCK": "constexpr", "SRC_EVICTION": "constexpr",
    "DST_CACHE": "constexpr",
}
# Both sides given as rows, no span mode, no cache hints.
ROWS_MODE = {"SRC_PAGE": 0, "DST_PAGE": 0, "SPAN_WORD": tl.int8, "SPAN_VEC": 1, "SPAN_ALIGN": 1,
             "SPAN_BLOCK": 0, "SRC_EVICTION": "", "DST_CACHE": ""}


def jit_kernel() -> JITFunction:
    fn = _copy_rows_kernel
    if isinstance(fn, InterpretedFunction):  # TRITON_INTERPRET=1 was set when it was made
        fn = JITFunction(fn.fn)
    return fn


def compile_sm90(constants: dict, *, index: str = "i32", num_warps: int = 4,
                 arch: int = 90):
    constants = {**ROWS_MODE, **constants}
    fn = jit_kernel()
    signature = dict(SIGNATURE, src_rows=f"*{index}", dst_rows=f"*{index}")
    # Pointer arguments are 16-byte aligned, as the launcher's tensors are.
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs={
        (fn.arg_names.index(name),): value for name, value in constants.items()})
    try:
        # No floating point in the kernel: fusing multiply-adds changes nothing.
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options={"enable_fp_fusion": False, "num_warps": num_warps})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton build
        if "ptxas" in str(e):
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise
    return kernel


def ptx_for(word, vec: int, word_bytes: int) -> str:
    constants = {"WORD": word, "VEC": vec, "ALIGN": vec * word_bytes, "ROWS": 8,
                 "BLOCK": 256, "COUNT_ERRORS": True}
    return compile_sm90(constants).asm["ptx"]


def test_aligned_rows_use_16_byte_vector_accesses():
    ptx = ptx_for(tl.int32, 4, 4)  # e.g. 656-byte rows in 16-byte aligned layers
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.parametrize(("word", "word_bytes"), [(tl.int32, 4), (tl.int16, 2), (tl.int8, 1)])
def test_unaligned_rows_compile_with_narrow_words(word, word_bytes):
    ptx = ptx_for(word, 1, word_bytes)
    assert "atom.global" in ptx or "red.global" in ptx  # the error counter
    assert "st.global" in ptx


# Per row class of the defaults: a row size whose rows, pitches and bases are 16-byte aligned
# (16-byte vectors) and an odd one (single bytes), as the launcher would see them.
ROW_SIZES = {"tiny": (128, 131), "small": (656, 657), "medium": (1152, 1153),
             "large": (8192, 8193)}


@pytest.mark.parametrize("index", ["i32", "i64"])
@pytest.mark.parametrize("count_errors", [True, False])
@pytest.mark.parametrize("rows_kind", ["aligned", "odd"])
@pytest.mark.parametrize("cls", sorted(DEFAULTS))
def test_every_default_specialisation_compiles(cls, rows_kind, count_errors, index):
    row_bytes = ROW_SIZES[cls][rows_kind == "odd"]
    assert row_class(row_bytes) == cls
    const = launch_constants(row_bytes, row_bytes, row_bytes, 256, default_config(row_bytes))
    assert const["ALIGN"] == (16 if rows_kind == "aligned" else 1)
    kernel = compile_sm90({**const, "COUNT_ERRORS": count_errors}, index=index)
    ptx = kernel.asm["ptx"]
    assert "st.global" in ptx
    if rows_kind == "aligned":
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert ("atom.global" in ptx or "red.global" in ptx) == count_errors


# The corners of the tuner's search space (kvmove.tuning.config_search), on 16-byte and
# 1-byte aligned rows. Triton 3.6's layout pass once refused 32-row steps that Triton 3.5
# and 3.9 compiled: scripts/test_triton_versions.sh runs this file under each.
CORNERS = [LaunchConfig(block_bytes=b, rows=r, num_warps=w, max_programs=16)
           for b, r in ((128, 1), (128, 64), (1024, 32), (8192, 1), (8192, 8)) for w in (1, 16)]


@pytest.mark.parametrize("row_bytes", [656, 131])
@pytest.mark.parametrize("config", CORNERS,
                         ids=lambda c: f"b{c.block_bytes}r{c.rows}w{c.num_warps}")
def test_the_tuner_corners_compile(config, row_bytes):
    const = launch_constants(row_bytes, row_bytes, row_bytes, 256, config)
    compile_sm90({**const, "COUNT_ERRORS": True}, index="i64", num_warps=config.num_warps)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize(("src_page", "dst_page"), [(64, 0), (0, 16), (1, 0)])
@pytest.mark.parametrize("cls", sorted(DEFAULTS))
def test_pages_given_as_slots_compile(cls, src_page, dst_page, arch):
    """A gather (staging side: dst) or scatter (src) whose staging side is page slots."""
    row_bytes = ROW_SIZES[cls][0]
    const = launch_constants(row_bytes, row_bytes, row_bytes, 256, default_config(row_bytes))
    kernel = compile_sm90({**const, "COUNT_ERRORS": True, "SRC_PAGE": src_page,
                           "DST_PAGE": dst_page}, arch=arch)
    assert "st.global" in kernel.asm["ptx"]


# The page-span mode (a gather or scatter of whole pages of dense rows): for every row size,
# odd ones included, a page of 16 or 64 rows is one 16-byte aligned span, copied in 16-byte
# vectors; the page-slot (host staging) side's stores stream (.cs), its loads evict first.
SPAN_ROW_BYTES = (4, 132, 576, 656, 1152, 4100)
ODD_ROW_BYTES = (4, 132, 4100)  # rows aligned to 4 bytes only: row mode moves 4-byte words


def launch_ptx(row_bytes: int, page_tokens: int, gathering: bool, arch: int = 90,
               **options) -> tuple[dict, str]:
    """The constants and the PTX of the launch ``copy_rows`` makes for a gather (KV rows ->
    staging slots) or scatter of ``page_tokens``-row pages on 256-byte aligned layers."""
    pages = (0, page_tokens) if gathering else (page_tokens, 0)
    const = dict(kernel_constants(row_bytes, row_bytes, row_bytes, 256,
                                  default_config(row_bytes), *pages, **options))
    num_warps = const.pop("num_warps")
    kernel = compile_sm90({**const, "COUNT_ERRORS": True}, index="i64", num_warps=num_warps,
                          arch=arch)
    return const, kernel.asm["ptx"]


STREAMING_V4_STORE = re.compile(r"st\.global\.cs\.v4\.")
EVICT_FIRST_V4_LOAD = re.compile(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.")


@pytest.mark.parametrize("gathering", [True, False], ids=["gather", "scatter"])
@pytest.mark.parametrize("page_tokens", [16, 64])
@pytest.mark.parametrize("row_bytes", SPAN_ROW_BYTES)
def test_page_spans_use_16_byte_vectors_and_streaming_hints(row_bytes, page_tokens, gathering):
    const, ptx = launch_ptx(row_bytes, page_tokens, gathering)
    assert const["SPAN_BLOCK"] > 0 and const["SPAN_ALIGN"] == 16
    assert "ld.global.v4" in ptx or EVICT_FIRST_V4_LOAD.search(ptx)
    assert "st.global.v4" in ptx or STREAMING_V4_STORE.search(ptx)
    if gathering:  # host writes: 16-byte streaming stores
        assert STREAMING_V4_STORE.search(ptx), "no st.global.cs.v4 on the staging side"
        assert "ld.global.L1::evict_first" not in ptx  # the KV side keeps its caching
    else:  # host reads: 16-byte loads that evict first; KV writes keep the default
        assert EVICT_FIRST_V4_LOAD.search(ptx), "no evict-first ld.global.v4 on staging"
        assert ".cs." not in ptx


@pytest.mark.parametrize("row_bytes", ODD_ROW_BYTES)
def test_the_16_byte_vectors_of_odd_rows_come_from_the_span_path(row_bytes):
    """Without the span mode the same launch of 4-byte aligned rows has no 16-byte store:
    the vectors above are the span path's."""
    const, ptx = launch_ptx(row_bytes, 64, True, spans=False)
    assert const["SPAN_BLOCK"] == 0 and const["ALIGN"] == 4
    assert ".v4." not in ptx.replace("ld.global.v4", "")  # no v4 store (a table load may be)
    assert "st.global.cs.b32" in ptx  # the row path's staging stores stream too


def test_cache_hints_can_be_turned_off():
    _, ptx = launch_ptx(132, 64, True, cache_hints=False)
    assert ".cs." not in ptx and "evict_first" not in ptx and "st.global.v4" in ptx


@pytest.mark.parametrize("arch", [80, 90])
def test_page_spans_compile_for_ampere_too(arch):
    const, ptx = launch_ptx(656, 16, False, arch=arch)
    assert const["SPAN_BLOCK"] and "st.global.v4" in ptx


def test_spans_apply_to_dense_power_of_two_pages_on_one_side():
    assert spans_apply(132, 132, 132, 0, 64) and spans_apply(4100, 4100, 4100, 16, 0)
    assert not spans_apply(132, 132, 132, 0, 1)  # one-token pages: the row path
    assert not spans_apply(132, 132, 132, 0, 24)  # not a power of two
    assert not spans_apply(132, 264, 132, 0, 64)  # a pitch wider than the row
    assert not spans_apply(132, 132, 132, 0, 0) and not spans_apply(132, 132, 132, 16, 16)


def test_the_run_sees_the_expected_triton():
    """``KVMOVE_EXPECT_TRITON`` (scripts/test_triton_versions.sh) names the version that must
    be the one imported: a wrong PYTHONPATH would otherwise test .venv's Triton again."""
    expected = os.environ.get("KVMOVE_EXPECT_TRITON")
    if expected:
        assert triton.__version__ == expected, (triton.__version__, triton.__file__)


_TABLE = torch.zeros(4, dtype=torch.int64)
_ROWS = torch.zeros(64, dtype=torch.int32)


def launch_args(**scalars) -> dict:
    """A launch's arguments, by name (the defaults overridden by ``scalars``)."""
    args = dict(src_table=_TABLE, dst_table=_TABLE, src_rows=_ROWS, dst_rows=_ROWS,
                errors=_ROWS, n=1, src_limit=1000, dst_limit=1000, src_pitch=41, dst_pitch=41,
                row_words=164, num_row_blocks=1, num_items=1, num_layers=4, span_vecs=0,
                span_layers=0, WORD=tl.int32, VEC=4, ALIGN=16,
                ROWS=8, BLOCK=256, COUNT_ERRORS=True, **ROWS_MODE)
    args.update(scalars)
    return args


def specialisation(**scalars):
    """The specialisation key Triton's launcher computes for a launch on an sm_90 GPU."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = jit_kernel()
    binder = create_function_from_signature(fn.signature, fn.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, _ = binder(**launch_args(**scalars))
    return dict(zip(fn.arg_names, spec, strict=True))


# Launches that Triton specialises apart from the default one (checked below): kvmove's own
# key of its compiled kernels (kernels/compiled_launch.py) must tell each of them apart too.
SPECIALISED_APART = {
    "src table 8-byte aligned": {"src_table": _TABLE[1:]},
    "dst table 8-byte aligned": {"dst_table": _TABLE[1:]},
    "int64 source rows": {"src_rows": _ROWS.long()},
    "int64 destination rows": {"dst_rows": _ROWS.long()},
    "int64 counter": {"errors": _ROWS.long()},
    "a 64-bit n": {"n": 2**31},
    "64-bit row blocks": {"num_row_blocks": 2**31},
    "64-bit items": {"num_items": 2**31},
    "source limit 1": {"src_limit": 1},
    "source limit 16": {"src_limit": 16},
    "destination limit 16": {"dst_limit": 16},
    "source pitch 1": {"src_pitch": 1},
    "destination pitch 32": {"dst_pitch": 32},
    "row words 16": {"row_words": 16},
    "int8 words": {"WORD": tl.int8},
    "VEC 2": {"VEC": 2},
    "ALIGN 8": {"ALIGN": 8},
    "ROWS 16": {"ROWS": 16},
    "BLOCK 128": {"BLOCK": 128},
    "no counting": {"COUNT_ERRORS": False},
    "source page slots": {"SRC_PAGE": 16},
    "destination page slots": {"DST_PAGE": 16},
    "layers 16": {"num_layers": 16},
    "span vectors 1": {"span_vecs": 1},
    "span blocks": {"SPAN_BLOCK": 512},
    "span words": {"SPAN_WORD": tl.int32},
    "span vectors": {"SPAN_VEC": 4},
    "span alignment": {"SPAN_ALIGN": 16},
    "streaming stores": {"DST_CACHE": ".cs"},
    "evict-first loads": {"SRC_EVICTION": "evict_first"},
}


@pytest.mark.parametrize("name", sorted(SPECIALISED_APART))
def test_kvmoves_launch_key_tells_apart_what_triton_specialises_apart(name):
    from kvmove.kernels.row_copy import _PARAMS, specialisation_key

    change = SPECIALISED_APART[name]
    assert specialisation(**change) != specialisation(), f"{name}: Triton keys it the same"

    def key(**scalars):
        args = launch_args(**scalars)
        return specialisation_key(tuple(args[p] for p in _PARAMS), 0, 4)

    assert key(**change) != key(), f"{name}: kvmove's key misses it"
    # Calls Triton keys alike (a new batch size, an index slice) keep kvmove's key.
    assert key(n=17, num_row_blocks=3, num_items=9, span_layers=5, src_rows=_ROWS[1:]) == key()


def test_per_call_scalars_are_not_specialised():
    fn = jit_kernel()
    flagged = {p.name for p in fn.params if p.do_not_specialize}
    assert flagged >= {"n", "num_row_blocks", "num_items", "span_layers"}
    base = specialisation()
    for value in (16, 17, 1 << 20):
        other = specialisation(n=value, num_row_blocks=value, num_items=value)
        assert other == base, f"a batch of {value} rows selects another kernel"
    # The check can tell: a specialised scalar (src_limit) keys 1 and 16 apart.
    assert specialisation(src_limit=1) != specialisation(src_limit=16)


def test_index_slices_at_odd_offsets_select_no_new_kernel():
    """A piece of a call is a slice of its index tensor; at an odd element offset its
    pointer is 8- (int64) or 4-byte (int32) aligned, not 16. Triton keys a pointer's 16-byte
    alignment unless told not to, so such a piece would compile a kernel while serving that
    the mover's warm-up (16-byte aligned indices) never compiled."""
    for dtype in (torch.int64, torch.int32):
        rows = torch.zeros(64, dtype=dtype)
        counter = torch.zeros(4, dtype=torch.int32)
        base = specialisation(src_rows=rows, dst_rows=rows, errors=counter)
        for offset in (1, 3):
            piece = rows[offset:]
            assert piece.data_ptr() % 16 != 0
            other = specialisation(src_rows=piece, dst_rows=piece,
                                   errors=counter[offset:])
            assert other == base, f"an index slice at offset {offset} ({dtype}) selects " \
                                  "another kernel"
    # The check can tell: the (aligned-specialised) address table keys alignment apart.
    table = torch.zeros(4, dtype=torch.int64)
    assert specialisation(src_table=table[1:]) != specialisation(src_table=table)
