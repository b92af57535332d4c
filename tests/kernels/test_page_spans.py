"""The row-copy kernel's page-span mode (through the Triton interpreter) writes the bytes a
per-row torch oracle writes, and counts the same errors: gathers (KV rows -> staging slots)
and scatters of whole aligned pages (one span per layer), pages cut by -1 padding, runs not
aligned to a page, KV rows and slots out of range (counted, never written: guard bytes
around the destination stay as they were), odd row sizes, several layers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmove.kernels import row_copy
from kvmove.kernels.alignment import pow2_alignment
from kvmove.kernels.configs import INTERPRETER_CONFIG
from tests.support.indices import first_only

pytestmark = [pytest.mark.usefixtures("triton_interpreter"), pytest.mark.interpreter]

ROW_BYTES = (4, 132, 576, 656, 1152, 4100)
GUARD = 64  # bytes before and after each destination pool


def guarded_pool(layers: int, rows: int, row_bytes: int, seed: int):
    """(pool [layers, rows, row_bytes] uint8, the buffer around it with GUARD bytes each
    side), both random."""
    g = torch.Generator().manual_seed(seed)
    size = layers * rows * row_bytes
    buffer = torch.randint(0, 256, (size + 2 * GUARD,), dtype=torch.uint8, generator=g)
    return buffer[GUARD:GUARD + size].view(layers, rows, row_bytes), buffer


def table(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([t[i].data_ptr() for i in range(t.shape[0])], dtype=torch.int64)


def kernel_copy(src, dst, src_index, dst_index, *, src_pages=0, dst_pages=0,
                spans=True) -> int:
    errors = torch.zeros(1, dtype=torch.int32)
    row_bytes = src.shape[2]
    src_table, dst_table = table(src), table(dst)
    row_copy.copy_rows(src_table, dst_table, src_index, dst_index, errors,
                       src_limit=src.shape[1], dst_limit=dst.shape[1], src_pitch=row_bytes,
                       dst_pitch=row_bytes, row_bytes=row_bytes,
                       base_alignment=pow2_alignment(*src_table.tolist(), *dst_table.tolist()),
                       config=INTERPRETER_CONFIG, src_page_tokens=src_pages,
                       dst_page_tokens=dst_pages, spans=spans)
    return int(errors.item())


def oracle_copy(src, dst, kv_rows: list[int], slots: list[int], page_tokens: int, *,
                gathering: bool) -> int:
    """Row ``t`` of page ``i``: KV row ``kv_rows[i * P + t]`` <-> staging row ``slots[i] *
    P + t``, in every layer, where both are in range; returns the rows with a bad side."""
    kv_limit = (src if gathering else dst).shape[1]
    num_slots = (dst if gathering else src).shape[1] // page_tokens
    errors = 0
    for i, slot in enumerate(slots):
        for t in range(page_tokens):
            kv = kv_rows[i * page_tokens + t]
            kv_bad, slot_bad = kv < -1 or kv >= kv_limit, slot < -1 or slot >= num_slots
            errors += kv_bad or slot_bad
            if kv < 0 or kv_bad or slot < 0 or slot_bad:
                continue
            staged = slot * page_tokens + t
            if gathering:
                dst[:, staged] = src[:, kv]
            else:
                dst[:, kv] = src[:, staged]
    return errors


@st.composite
def kv_pages(draw, pages: int, page_tokens: int, kv_rows: int) -> list[int]:
    """``pages * page_tokens`` KV rows: each page a whole aligned page, one cut by -1, a run
    off the page grid, scattered rows, or a page with a row out of range."""
    rows = []
    for _ in range(pages):
        kind = draw(st.sampled_from(["whole", "whole", "cut", "shifted", "scattered", "bad"]))
        first = draw(st.integers(0, kv_rows // page_tokens - 1)) * page_tokens
        page = list(range(first, first + page_tokens))
        if kind == "cut":
            cut = draw(st.integers(0, page_tokens - 1))
            page = page[:cut] + [-1] * (page_tokens - cut)
        elif kind == "shifted" and first + page_tokens < kv_rows:
            page = [r + 1 for r in page]
        elif kind == "scattered":
            page = draw(st.lists(st.integers(-1, kv_rows - 1), min_size=page_tokens,
                                 max_size=page_tokens))
        elif kind == "bad":
            page[draw(st.integers(0, page_tokens - 1))] = draw(
                st.sampled_from([kv_rows, kv_rows + 7, -2, -5]))
        rows += page
    return rows


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), row_bytes=st.sampled_from(ROW_BYTES),
       page_tokens=st.sampled_from([2, 4, 16]), layers=st.integers(1, 3),
       gathering=st.booleans(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_page_spans_write_what_the_oracle_writes(data, row_bytes, page_tokens, layers,
                                                 gathering, index_dtype):
    num_slots, kv_pages_total = 4, 5
    kv_rows = kv_pages_total * page_tokens
    pages = data.draw(st.integers(1, 4))
    kv_index = data.draw(kv_pages(pages, page_tokens, kv_rows))
    slots = data.draw(st.lists(st.one_of(st.integers(0, num_slots - 1), st.just(-1),
                                         st.just(num_slots), st.just(-3)),
                               min_size=pages, max_size=pages))
    slots = first_only(slots, num_slots)  # a gather's destinations: distinct slots
    if not gathering:  # a scatter's: distinct KV rows
        kv_index = first_only(kv_index, kv_rows)
    assert row_copy.spans_apply(row_bytes, row_bytes, row_bytes, 0, page_tokens)
    kv, _ = guarded_pool(layers, kv_rows, row_bytes, seed=1)
    staging, _ = guarded_pool(layers, num_slots * page_tokens, row_bytes, seed=2)
    src, dst = (kv, staging) if gathering else (staging, kv)
    got, got_buffer = guarded_pool(*dst.shape, seed=3)
    want, want_buffer = guarded_pool(*dst.shape, seed=3)
    kv_t = torch.tensor(kv_index, dtype=index_dtype)
    slots_t = torch.tensor(slots, dtype=index_dtype)
    if gathering:
        errors = kernel_copy(src, got, kv_t, slots_t, dst_pages=page_tokens)
    else:
        errors = kernel_copy(src, got, slots_t, kv_t, src_pages=page_tokens)
    want_errors = oracle_copy(src, want, kv_index, slots, page_tokens, gathering=gathering)
    assert torch.equal(got_buffer, want_buffer)  # the pool, and the guard bytes around it
    assert errors == want_errors


@pytest.mark.parametrize("row_bytes", [132, 4100])
@pytest.mark.parametrize("gathering", [True, False], ids=["gather", "scatter"])
def test_whole_pages_move_as_spans_and_match_the_row_mode(row_bytes, gathering):
    """Whole 16-token pages (the span path proper) and one cut page: the span mode and the
    row mode write the same bytes, equal to the pages themselves."""
    P, layers = 16, 3
    kv, _ = guarded_pool(layers, 6 * P, row_bytes, seed=4)
    staging, _ = guarded_pool(layers, 4 * P, row_bytes, seed=5)
    kv_index = torch.cat([torch.arange(5 * P, 6 * P), torch.arange(0, P),
                          torch.arange(2 * P, 3 * P)])
    kv_index[2 * P + 5] = -1  # the third page is cut
    slots = torch.tensor([2, 0, 3])
    src, dst = (kv, staging) if gathering else (staging, kv)
    results = []
    for spans in (True, False):
        out, buffer = guarded_pool(*dst.shape, seed=6)
        if gathering:
            errors = kernel_copy(src, out, kv_index, slots, dst_pages=P, spans=spans)
        else:
            errors = kernel_copy(src, out, slots, kv_index, src_pages=P, spans=spans)
        assert errors == 0
        results.append(buffer)
        for page, slot in ((5, 2), (0, 0)):  # whole pages: every row of every layer
            kv_rows, staged = slice(page * P, page * P + P), slice(slot * P, slot * P + P)
            if gathering:
                assert torch.equal(out[:, staged], kv[:, kv_rows])
            else:
                assert torch.equal(out[:, kv_rows], staging[:, staged])
    assert torch.equal(results[0], results[1])


def test_a_bad_slot_of_a_whole_page_counts_its_rows_once_and_writes_nothing():
    P = 4
    kv, _ = guarded_pool(3, 4 * P, 132, seed=7)
    staging, buffer = guarded_pool(3, 2 * P, 132, seed=8)
    before = buffer.clone()
    errors = kernel_copy(kv, staging, torch.arange(2 * P), torch.tensor([2, -2]),
                         dst_pages=P)
    assert errors == 2 * P  # every row of both pages, once (not once per layer)
    assert torch.equal(buffer, before)
