"""The row-copy kernel (through the Triton interpreter) with one side given as page slots
moves the same bytes and counts the same errors as with that side given as the rows the
slots stand for: for gathers (staging side: destination) and scatters (source), odd row
sizes, several layers, skipped (-1) and bad slots and rows. Page counts that are powers of
two run the page-span mode (tests/kernels/test_page_spans.py), 3 the row mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmove.kernels import row_copy
from kvmove.kernels.configs import INTERPRETER_CONFIG
from kvmove.rows.row_numbers import page_rows
from tests.support.indices import first_only

pytestmark = [pytest.mark.usefixtures("triton_interpreter"), pytest.mark.interpreter]


def pool(layers: int, rows: int, row_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layers, rows, row_bytes), dtype=torch.uint8, generator=g)


def table(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([t[i].data_ptr() for i in range(t.shape[0])], dtype=torch.int64)


def copy(src, dst, src_index, dst_index, *, src_pages=0, dst_pages=0) -> int:
    errors = torch.zeros(1, dtype=torch.int32)
    row_bytes = src.shape[2]
    row_copy.copy_rows(table(src), table(dst), src_index, dst_index, errors,
                       src_limit=src.shape[1], dst_limit=dst.shape[1], src_pitch=row_bytes,
                       dst_pitch=row_bytes, row_bytes=row_bytes, base_alignment=1,
                       config=INTERPRETER_CONFIG, src_page_tokens=src_pages,
                       dst_page_tokens=dst_pages)
    return int(errors.item())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_tokens=st.sampled_from([1, 2, 3, 16]),
       row_bytes=st.sampled_from([4, 6, 132, 656]), layers=st.integers(1, 3),
       gathering=st.booleans(), index_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_page_slots_move_what_their_rows_move(data, page_tokens, row_bytes, layers, gathering,
                                              index_dtype):
    slots_total, kv_rows = 5, 40
    n = data.draw(st.integers(1, 4))
    slots = torch.tensor(data.draw(st.lists(
        st.one_of(st.integers(0, slots_total - 1), st.just(-1), st.just(slots_total),
                  st.just(-3)), min_size=n, max_size=n)), dtype=index_dtype)
    kv_index = torch.tensor(data.draw(st.lists(
        st.one_of(st.integers(0, kv_rows - 1), st.just(-1), st.just(kv_rows)),
        min_size=n * page_tokens, max_size=n * page_tokens)), dtype=index_dtype)
    # a destination's repeats skipped: the two modes order the racing copies differently
    if gathering:
        slots = torch.tensor(first_only(slots.tolist(), slots_total), dtype=index_dtype)
    else:
        kv_index = torch.tensor(first_only(kv_index.tolist(), kv_rows), dtype=index_dtype)
    kv = pool(layers, kv_rows, row_bytes, seed=1)
    staging = pool(layers, slots_total * page_tokens, row_bytes, seed=2)
    # The rows the slots stand for, as the row path numbers them (a bad slot: rows that
    # are out of range, -1: rows skipped)
    rows = page_rows(slots, page_tokens).to(index_dtype)
    if gathering:
        src, dst = kv, staging
        want_dst, got_dst = dst.clone(), dst.clone()
        want = copy(src, want_dst, kv_index, rows)
        got = copy(src, got_dst, kv_index, slots, dst_pages=page_tokens)
    else:
        src, dst = staging, kv
        want_dst, got_dst = dst.clone(), dst.clone()
        want = copy(src, want_dst, rows, kv_index)
        got = copy(src, got_dst, slots, kv_index, src_pages=page_tokens)
    assert torch.equal(got_dst, want_dst)
    assert got == want


def test_a_slot_past_the_pool_counts_its_rows_and_writes_nothing():
    kv, staging = pool(2, 16, 132, seed=3), pool(2, 8, 132, seed=4)
    before = staging.clone()
    errors = copy(kv, staging, torch.arange(8), torch.tensor([2, -2]), dst_pages=4)
    assert errors == 8  # every row of both pages: slot 2 of 2 and slot -2
    assert torch.equal(staging, before)
    errors = copy(kv, staging, torch.arange(8), torch.tensor([1, -1]), dst_pages=4)
    assert errors == 0
    assert torch.equal(staging[:, 4:8], kv[:, 0:4]) and torch.equal(staging[:, :4], before[:, :4])


def test_the_launcher_names_a_bad_page_count():
    kv, staging = pool(1, 16, 4, seed=5), pool(1, 8, 4, seed=6)
    with pytest.raises(ValueError, match="dst_rows for 8"):
        copy(kv, staging, torch.arange(6), torch.tensor([0, 1]), dst_pages=4)
    with pytest.raises(ValueError, match="dst_page_tokens must be an int >= 0, got -4"):
        copy(kv, staging, torch.arange(8), torch.tensor([0, 1]), dst_pages=-4)
