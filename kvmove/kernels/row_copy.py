"""Copy rows between two row pools, for a set of layers, in one launch.

Row ``src_rows[i]`` of layer ``layers[j]`` of the source pool is copied to row
``dst_rows[i]`` of the same layer of the destination pool, for every ``i`` and ``j``. Each
pool is given by a table of per-layer base addresses (layers need not be contiguous) and
a row pitch. ``-1`` on either side skips that row; any other index outside the pool is
never read or written but counted in a device error counter. Either side may instead be
given by page slots of ``P`` rows (a staging buffer's pages): row ``i`` of that side is
then ``slots[i // P] * P + i % P``, worked out in the kernel, so that a gather or scatter of
pages launches on the caller's indices as they are, with no row list made per call.
Where rows are dense (pitch = row size) and ``P`` a power of two, the page-span mode copies
each page whose rows are one aligned run ``p * P ..`` as one span of ``P`` rows per layer,
in vectors of the span's own alignment (16 B for ``P >= 16`` on 16-byte aligned layers,
whatever the row size); its indices are loaded once per page, not once per layer. The
page-slot side's accesses carry streaming cache hints (stores ``.cs``, loads evict-first).
"""

from __future__ import annotations

import functools
import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvmove.kernels.alignment import pow2_alignment
from kvmove.kernels.compiled_launch import CompiledLaunches
from kvmove.kernels.configs import LaunchConfig

_WORD_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32}
_THREADS_PER_WARP = 32
# The cache hints on the page-slot (staging) side, where that side is host memory read or
# written once: its loads evict first, its stores stream (.cs). "" is Triton's default.
STAGING_LOAD_EVICTION = "evict_first"
STAGING_STORE_CACHE = ".cs"


@triton.jit
def _add(a, b):  # the combine function of a sum (tl.sum itself fails in the late interpreter)
    return a + b


# Per-call scalars are not specialised on: a new batch size never compiles a new kernel.
# Nor are the per-call pointers (row indices, error counter) on their 16-byte alignment: a
# slice of an index tensor at an odd offset (a piece of a larger call) would otherwise
# compile a kernel while serving that the warm-up never made. Their loads are a few bytes
# per row; the tables and the rows themselves keep their alignment hints.
@triton.jit(do_not_specialize=["n", "num_row_blocks", "num_items", "span_layers", "src_rows",
                               "dst_rows", "errors"])
def _copy_rows_kernel(
    src_table,  # int64 [L]: device address of each selected layer of the source
    dst_table,  # int64 [L]: the same for the destination
    src_rows,  # int32/int64 [n], or [n / SRC_PAGE] page slots
    dst_rows,  # int32/int64 [n], or [n / DST_PAGE] page slots
    errors,  # int32 [1]: incremented by the number of out-of-range rows
    n,
    src_limit,  # rows in the source pool
    dst_limit,  # rows in the destination pool
    src_pitch,  # source row pitch, in units of VEC words
    dst_pitch,  # destination row pitch, in units of VEC words
    row_words,  # words per row
    num_row_blocks,  # row mode: row blocks per layer; span mode: layer groups per page
    num_items,  # row mode: layers * num_row_blocks; span mode: pages * num_row_blocks
    num_layers,  # L
    span_vecs,  # span mode: SPAN_VEC-word vectors in one page span (P rows); else 0
    span_layers,  # span mode: layers per layer group; else 0
    WORD: tl.constexpr,  # element type of one word (int8/int16/int32)
    VEC: tl.constexpr,  # words per aligned vector: base addresses and pitches are multiples
    ALIGN: tl.constexpr,  # bytes: every base address is a multiple of this (= VEC * word)
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # words per inner step
    COUNT_ERRORS: tl.constexpr,
    SRC_PAGE: tl.constexpr,  # 0: src_rows holds rows; P: page slots of P rows
    DST_PAGE: tl.constexpr,
    SPAN_WORD: tl.constexpr,  # span mode (SPAN_BLOCK > 0): the element type of a span
    SPAN_VEC: tl.constexpr,  # words per vector; every span start is a multiple of SPAN_ALIGN
    SPAN_ALIGN: tl.constexpr,
    SPAN_BLOCK: tl.constexpr,  # words per half step of a span; 0: row mode
    SRC_EVICTION: tl.constexpr,  # eviction policy of the source's loads ("": the default)
    DST_CACHE: tl.constexpr,  # cache modifier of the destination's stores ("": the default)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if SPAN_BLOCK == 0:
        # Row mode: an item is (layer, block of ROWS rows).
        row_offs = tl.arange(0, ROWS)
        col_offs = tl.arange(0, BLOCK)
        for item in range(pid, num_items, nprog):
            layer = item // num_row_blocks
            block = item % num_row_blocks
            idx = block * ROWS + row_offs
            in_batch = idx < n
            # Each side's row of each idx, and whether it is in range or bad (neither: a skip).
            if SRC_PAGE == 0:
                s = tl.load(src_rows + idx, mask=in_batch, other=-1).to(tl.int64)
                s_ok, s_bad = (s >= 0) & (s < src_limit), (s < -1) | (s >= src_limit)
            else:  # page slots: checked as slots, so a huge slot never wraps onto a real row
                src_slot = tl.load(src_rows + idx // SRC_PAGE, mask=in_batch,
                                   other=-1).to(tl.int64)
                s = src_slot * SRC_PAGE + idx % SRC_PAGE
                src_slots = src_limit // SRC_PAGE
                s_ok = (src_slot >= 0) & (src_slot < src_slots)
                s_bad = (src_slot < -1) | (src_slot >= src_slots)
            if DST_PAGE == 0:
                d = tl.load(dst_rows + idx, mask=in_batch, other=-1).to(tl.int64)
                d_ok, d_bad = (d >= 0) & (d < dst_limit), (d < -1) | (d >= dst_limit)
            else:
                dst_slot = tl.load(dst_rows + idx // DST_PAGE, mask=in_batch,
                                   other=-1).to(tl.int64)
                d = dst_slot * DST_PAGE + idx % DST_PAGE
                dst_slots = dst_limit // DST_PAGE
                d_ok = (dst_slot >= 0) & (dst_slot < dst_slots)
                d_bad = (dst_slot < -1) | (dst_slot >= dst_slots)
            bad = in_batch & (s_bad | d_bad)
            ok = in_batch & s_ok & d_ok
            if COUNT_ERRORS:
                # Count each bad row once: in the items of the first selected layer.
                first_layer = (row_offs * 0 + layer) == 0
                tl.atomic_add(errors + row_offs * 0, 1, mask=bad & first_layer)
            # The alignment hint goes on the pointer (in bytes), after the cast: on the
            # integer it would not survive the cast and the compiler would emit one access
            # per word.
            src_base = tl.multiple_of(tl.load(src_table + layer).to(tl.pointer_type(WORD)),
                                      ALIGN)
            dst_base = tl.multiple_of(tl.load(dst_table + layer).to(tl.pointer_type(WORD)),
                                      ALIGN)
            # Row starts, in words, written as (rows * pitch_in_vectors) * VEC so that the
            # compiler sees VEC-aligned offsets and emits wide accesses. A skipped or bad
            # row's start is never dereferenced (its mask is off), so it is not clamped: a
            # tl.where(ok, s, 0) here fed both the load and the store, and Triton 3.6's
            # layout pass refused the kernel for 32-row steps.
            src_start = tl.multiple_of((s * src_pitch) * VEC, VEC)
            dst_start = tl.multiple_of((d * dst_pitch) * VEC, VEC)
            for c in range(0, row_words, BLOCK):
                cols = c + col_offs
                mask = ok[:, None] & ((cols // VEC)[None, :] < row_words // VEC)
                v = tl.load(src_base + src_start[:, None] + cols[None, :], mask=mask,
                            eviction_policy=SRC_EVICTION)
                tl.store(dst_base + dst_start[:, None] + cols[None, :], v, mask=mask,
                         cache_modifier=DST_CACHE)
    else:
        # Span mode: one side page slots of P rows, the other rows (P per page). An item is
        # (page, group of layers). A page whose rows are the aligned run p * P .. in range,
        # into a slot in range, moves as one span per layer; any other in ROWS-row steps.
        P: tl.constexpr = SRC_PAGE + DST_PAGE  # one of them is 0
        KV_IS_SRC: tl.constexpr = DST_PAGE > 0  # a gather: the rows side is the source
        tok = tl.arange(0, P)
        span_offs = tl.arange(0, SPAN_BLOCK)
        col_offs = tl.arange(0, BLOCK)
        for item in range(pid, num_items, nprog):
            page = item // num_row_blocks
            group = item % num_row_blocks
            first = group * span_layers
            last = tl.minimum(first + span_layers, num_layers)
            if KV_IS_SRC:
                page_rows = src_rows + page * P  # this page's KV rows
                slot = tl.load(dst_rows + page).to(tl.int64)
                kv_limit = src_limit
                num_slots = dst_limit // P
            else:
                page_rows = dst_rows + page * P
                slot = tl.load(src_rows + page).to(tl.int64)
                kv_limit = dst_limit
                num_slots = src_limit // P
            # Loaded once per item: for every layer of its group.
            kv = tl.load(page_rows + tok).to(tl.int64)
            kv0 = tl.load(page_rows).to(tl.int64)
            run = tl.reduce((kv != kv0 + tok).to(tl.int32), 0, _add) == 0
            whole = (run & (kv0 >= 0) & (kv0 % P == 0) & (kv0 + P <= kv_limit) & (slot >= 0)
                     & (slot < num_slots))
            if whole:
                if KV_IS_SRC:
                    src_page = kv0 // P
                    dst_page = slot
                else:
                    src_page = slot
                    dst_page = kv0 // P
                src_off = tl.multiple_of((src_page * span_vecs) * SPAN_VEC, SPAN_VEC)
                dst_off = tl.multiple_of((dst_page * span_vecs) * SPAN_VEC, SPAN_VEC)
                for layer in range(first, last):
                    src = tl.multiple_of(
                        tl.load(src_table + layer).to(tl.pointer_type(SPAN_WORD)), SPAN_ALIGN)
                    dst = tl.multiple_of(
                        tl.load(dst_table + layer).to(tl.pointer_type(SPAN_WORD)), SPAN_ALIGN)
                    # Two blocks loaded before either is stored: more bytes in flight.
                    for c in range(0, span_vecs * SPAN_VEC, 2 * SPAN_BLOCK):
                        a = c + span_offs
                        b = a + SPAN_BLOCK
                        mask_a = (a // SPAN_VEC) < span_vecs
                        mask_b = (b // SPAN_VEC) < span_vecs
                        va = tl.load(src + src_off + a, mask=mask_a, eviction_policy=SRC_EVICTION)
                        vb = tl.load(src + src_off + b, mask=mask_b, eviction_policy=SRC_EVICTION)
                        tl.store(dst + dst_off + a, va, mask=mask_a, cache_modifier=DST_CACHE)
                        tl.store(dst + dst_off + b, vb, mask=mask_b, cache_modifier=DST_CACHE)
            else:
                for r in range(0, P, ROWS):
                    t = r + tl.arange(0, ROWS)
                    in_page = t < P
                    slots = t * 0 + slot  # as a vector: scalar masks mix badly here
                    slot_ok = (slots >= 0) & (slots < num_slots) & in_page
                    slot_bad = ((slots < -1) | (slots >= num_slots)) & in_page
                    if KV_IS_SRC:
                        s = tl.load(page_rows + t, mask=in_page, other=-1).to(tl.int64)
                        s_ok, s_bad = (s >= 0) & (s < src_limit), (s < -1) | (s >= src_limit)
                        d = slots * P + t
                        d_ok, d_bad = slot_ok, slot_bad
                    else:
                        s = slots * P + t
                        s_ok, s_bad = slot_ok, slot_bad
                        d = tl.load(page_rows + t, mask=in_page, other=-1).to(tl.int64)
                        d_ok, d_bad = (d >= 0) & (d < dst_limit), (d < -1) | (d >= dst_limit)
                    ok = s_ok & d_ok
                    if COUNT_ERRORS:  # each bad row once: in its page's first layer group
                        first_group = (t * 0 + group) == 0
                        tl.atomic_add(errors + t * 0, 1, mask=(s_bad | d_bad) & first_group)
                    src_start = tl.multiple_of((s * src_pitch) * VEC, VEC)
                    dst_start = tl.multiple_of((d * dst_pitch) * VEC, VEC)
                    for layer in range(first, last):
                        src_base = tl.multiple_of(
                            tl.load(src_table + layer).to(tl.pointer_type(WORD)), ALIGN)
                        dst_base = tl.multiple_of(
                            tl.load(dst_table + layer).to(tl.pointer_type(WORD)), ALIGN)
                        for c in range(0, row_words, BLOCK):
                            cols = c + col_offs
                            mask = ok[:, None] & ((cols // VEC)[None, :] < row_words // VEC)
                            v = tl.load(src_base + src_start[:, None] + cols[None, :],
                                        mask=mask, eviction_policy=SRC_EVICTION)
                            tl.store(dst_base + dst_start[:, None] + cols[None, :], v,
                                     mask=mask, cache_modifier=DST_CACHE)


@functools.lru_cache(maxsize=1024)
def launch_constants(row_bytes: int, src_pitch: int, dst_pitch: int, base_alignment: int,
                     config: LaunchConfig) -> types.MappingProxyType:
    """The compile-time constants of a launch (all but ``COUNT_ERRORS``, the page sides and
    the span mode): the widest aligned access (``ALIGN`` bytes, ``VEC`` words of ``WORD``),
    ``ROWS`` and ``BLOCK``. Worked out once per geometry, shared: read-only."""
    align = pow2_alignment(row_bytes, src_pitch, dst_pitch, base_alignment)
    word = min(align, 4)
    vec = align // word
    block = max(triton.next_power_of_2(config.block_bytes // word), vec)
    block = min(block, max(triton.next_power_of_2(row_bytes // word), vec))
    return types.MappingProxyType({"WORD": _WORD_TYPES[word], "VEC": vec, "ALIGN": align,
                                   "ROWS": config.rows, "BLOCK": block})


_NO_SPAN = types.MappingProxyType({"SPAN_WORD": tl.int8, "SPAN_VEC": 1, "SPAN_ALIGN": 1,
                                   "SPAN_BLOCK": 0})


def spans_apply(row_bytes: int, src_pitch: int, dst_pitch: int, src_page_tokens: int,
                dst_page_tokens: int) -> bool:
    """Whether a launch can run in page-span mode: one side page slots of ``P`` rows, ``P`` a
    power of two >= 2, the other rows, and both sides dense (pitch = ``row_bytes``)."""
    page = src_page_tokens + dst_page_tokens
    return (min(src_page_tokens, dst_page_tokens) == 0 and page >= 2 and page & (page - 1) == 0
            and src_pitch == dst_pitch == row_bytes)


@functools.lru_cache(maxsize=1024)
def span_constants(row_bytes: int, page_tokens: int, base_alignment: int,
                   config: LaunchConfig) -> types.MappingProxyType:
    """The span mode's constants: a page span of ``page_tokens * row_bytes`` bytes starts at
    a multiple of ``SPAN_ALIGN``, the power of two dividing the span size and every layer's
    base (not the row size: 64 rows of 132 B are 16-byte aligned spans). ``num_warps``: at
    most one warp per 32 vectors of a span; ``SPAN_BLOCK``: one vector per thread per half
    step (Triton vectorises only blocks of at least that); ``ROWS`` at most ``page_tokens``."""
    span = page_tokens * row_bytes
    align = pow2_alignment(span, base_alignment)
    word = min(align, 4)
    vec = align // word
    warp_vectors = span // align // _THREADS_PER_WARP
    warps = min(config.num_warps, 1 << max(warp_vectors, 1).bit_length() - 1)
    return types.MappingProxyType({"SPAN_WORD": _WORD_TYPES[word], "SPAN_VEC": vec,
                                   "SPAN_ALIGN": align,
                                   "SPAN_BLOCK": warps * _THREADS_PER_WARP * vec,
                                   "ROWS": min(config.rows, page_tokens), "num_warps": warps})


@functools.lru_cache(maxsize=1024)
def kernel_constants(row_bytes: int, src_pitch: int, dst_pitch: int, base_alignment: int,
                     config: LaunchConfig, src_page_tokens: int = 0, dst_page_tokens: int = 0,
                     *, spans: bool = True, cache_hints: bool = True) -> types.MappingProxyType:
    """Every constexpr of a launch but ``COUNT_ERRORS``, by name, and its ``num_warps``: the
    row mode's (:func:`launch_constants`), the span mode's where ``spans`` and
    :func:`spans_apply` (else ``SPAN_BLOCK`` 0), the cache hints of the page-slot side."""
    const = dict(launch_constants(row_bytes, src_pitch, dst_pitch, base_alignment, config))
    const.update(_NO_SPAN, num_warps=config.num_warps, SRC_PAGE=src_page_tokens,
                 DST_PAGE=dst_page_tokens)
    if spans and spans_apply(row_bytes, src_pitch, dst_pitch, src_page_tokens,
                             dst_page_tokens):
        const.update(span_constants(row_bytes, src_page_tokens + dst_page_tokens,
                                    base_alignment, config))
    const["SRC_EVICTION"] = STAGING_LOAD_EVICTION if cache_hints and src_page_tokens else ""
    const["DST_CACHE"] = STAGING_STORE_CACHE if cache_hints and dst_page_tokens else ""
    return types.MappingProxyType(const)


@functools.lru_cache(maxsize=1024)
def _constexpr_args(*key, spans: bool, cache_hints: bool) -> tuple[tuple, tuple, dict]:
    """:func:`kernel_constants` as the launch takes them: the constexprs before
    ``COUNT_ERRORS`` and after it, in order, and the mapping."""
    const = kernel_constants(*key, spans=spans, cache_hints=cache_hints)
    names = _PARAMS[_POSITIONAL:]
    return (tuple(const[n] for n in names[:5]), tuple(const[n] for n in names[6:]), const)


def _span_grid(pages: int, layers: int, max_programs: int) -> tuple[int, int]:
    """(layer groups per page, layers per group): enough items to fill ``max_programs``
    programs, each page's indices loaded once per group."""
    groups = min(layers, -(-max_programs // pages))
    per_group = -(-layers // groups)
    return -(-layers // per_group), per_group


def _kernel_for(device: torch.device):
    """The compiled kernel on a GPU; the Triton interpreter on the CPU (whether or not
    ``TRITON_INTERPRET=1`` was set when this module was imported)."""
    if device.type != "cpu" or isinstance(_copy_rows_kernel, InterpretedFunction):
        return _copy_rows_kernel
    global _interpreted
    if _interpreted is None:
        _interpreted = InterpretedFunction(_copy_rows_kernel.fn)
    return _interpreted


_interpreted = None


def copy_rows(
    src_table: torch.Tensor,
    dst_table: torch.Tensor,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    errors: torch.Tensor | None,
    *,
    src_limit: int,
    dst_limit: int,
    src_pitch: int,
    dst_pitch: int,
    row_bytes: int,
    base_alignment: int,
    config: LaunchConfig,
    src_page_tokens: int = 0,
    dst_page_tokens: int = 0,
    spans: bool = True,
    cache_hints: bool = True,
) -> None:
    """Launch the row copy. ``src_table`` / ``dst_table``: int64 ``[L]`` device addresses
    of each layer's row 0 (UVA addresses for pinned host memory), on the kernel's device.
    ``src_rows`` / ``dst_rows``: int32/int64 ``[n]`` on that device; ``-1`` on either side
    skips the row, any other index outside ``[0, src_limit)`` / ``[0, dst_limit)`` is
    skipped and added to ``errors`` (int32 ``[1]``, once per row, not per layer; ``None``
    counts nothing). ``src_page_tokens`` / ``dst_page_tokens`` ``P > 0``: that side holds
    ``n / P`` page slots, slot ``s`` standing for rows ``s * P .. s * P + P - 1`` (``-1``
    skips the page, a slot outside ``[0, limit / P)`` counts all its rows); ``0``: rows.
    Pitches and ``row_bytes`` are bytes; ``base_alignment`` is a power of two dividing
    every address in both tables. ``spans``: page-span mode where :func:`spans_apply`
    (the same bytes moved); ``cache_hints``: streaming hints on the page-slot side.
    ``ValueError`` for a negative or non-int page count.
    """
    for name, p in (("src_page_tokens", src_page_tokens), ("dst_page_tokens", dst_page_tokens)):
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"{name} must be an int >= 0, got {p!r}")
    n = src_rows.numel() * max(src_page_tokens, 1)
    layers = src_table.numel()
    if dst_rows.numel() * max(dst_page_tokens, 1) != n:
        raise ValueError(f"src_rows stands for {n} rows but dst_rows for "
                         f"{dst_rows.numel() * max(dst_page_tokens, 1)}")
    if dst_table.numel() != layers:
        raise ValueError(f"src_table has {layers} layers but dst_table has {dst_table.numel()}")
    for name, t in (("src_table", src_table), ("dst_table", dst_table)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {t.dtype}")
    for name, t in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if errors is not None and (errors.dtype != torch.int32 or errors.numel() != 1):
        raise TypeError(f"errors must be an int32 tensor of one element, got {errors.dtype}")
    if n == 0 or layers == 0:
        return
    head, tail, const = _constexpr_args(row_bytes, src_pitch, dst_pitch, base_alignment,
                                        config, src_page_tokens, dst_page_tokens,
                                        spans=spans, cache_hints=cache_hints)
    align, rows, num_warps = const["ALIGN"], const["ROWS"], const["num_warps"]
    word = align // const["VEC"]
    span_vecs = span_layers = 0
    if const["SPAN_BLOCK"]:
        page_tokens = src_page_tokens + dst_page_tokens
        span_vecs = page_tokens * row_bytes // const["SPAN_ALIGN"]
        num_row_blocks, span_layers = _span_grid(n // page_tokens, layers,
                                                 config.max_programs)
        num_items = n // page_tokens * num_row_blocks
    else:
        num_row_blocks = -(-n // rows)
        num_items = layers * num_row_blocks
    grid = max(1, min(num_items, config.max_programs))
    counter = src_rows if errors is None else errors  # any pointer when not counting
    args = (src_table, dst_table, src_rows, dst_rows, counter, n, src_limit, dst_limit,
            src_pitch // align, dst_pitch // align, row_bytes // word, num_row_blocks,
            num_items, layers, span_vecs, span_layers, *head, errors is not None, *tail)
    device = src_table.device
    if device.type == "cpu":  # the interpreter
        _launches.through_triton(_kernel_for(device), grid, args, num_warps)
        return
    key = specialisation_key(args, device.index, num_warps)
    if torch.cuda.current_device() == device.index:
        _launches.launch(key, grid, args, device.index, num_warps)
        return
    with torch.cuda.device(device):  # Triton launches on the current device's context
        _launches.launch(key, grid, args, device.index, num_warps)


def specialisation_key(args: tuple, device_index: int, num_warps: int) -> tuple:
    """Everything the kernel is specialised on, for a launch with ``args`` (every parameter,
    in order): the tables' 16-byte alignment, the dtypes of the row and counter pointers
    (``do_not_specialize``: not their alignment), the per-call integers by their width
    (``do_not_specialize``), the geometry integers by value, every constexpr, the warps and
    the device."""
    tables_aligned = (args[0].data_ptr() % 16 == 0, args[1].data_ptr() % 16 == 0)
    widths = tuple(-2**31 <= v < 2**31 for v in (args[5], args[11], args[12], args[15]))
    return (device_index, args[2].dtype, args[3].dtype, args[4].dtype, *tables_aligned,
            *widths, *args[6:11], args[13], args[14], *args[16:], num_warps)


# Every parameter of the kernel, in order; the first _POSITIONAL are not constexpr.
_PARAMS = ("src_table", "dst_table", "src_rows", "dst_rows", "errors", "n", "src_limit",
           "dst_limit", "src_pitch", "dst_pitch", "row_words", "num_row_blocks", "num_items",
           "num_layers", "span_vecs", "span_layers", "WORD", "VEC", "ALIGN", "ROWS", "BLOCK",
           "COUNT_ERRORS", "SRC_PAGE", "DST_PAGE", "SPAN_WORD", "SPAN_VEC", "SPAN_ALIGN",
           "SPAN_BLOCK", "SRC_EVICTION", "DST_CACHE")
_POSITIONAL = 16
_launches = CompiledLaunches(_copy_rows_kernel, _PARAMS, _POSITIONAL)
