"""The one-pass plan of a gather or scatter of any pages (plan_page_rows): the same rows,
errors and whole pages as planning the pages' row lists, for scattered, padded, aligned and
out-of-range pages; and the one-shot gather/scatter that use it move the same bytes as a
per-row reference, for odd row sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.plan import SMALL_PLAN_ROWS, Part, plan_few_pages, plan_page_rows, plan_rows
from kvmove.rows.row_numbers import page_rows
from tests.support.caches import ROW_BYTES

SETTINGS = settings(max_examples=80, deadline=None)


def moved_pairs(plan, page_tokens: int) -> list[tuple[int, int]]:
    """Every (src row, dst row) a plan moves: its whole pages in rows, then the rest."""
    def pairs(part: Part, unit: int):
        return [(s * unit + t, d * unit + t) for s, d in
                zip(part.src.tolist(), part.dst.tolist(), strict=True) for t in range(unit)]
    if not plan.some_whole:
        return sorted(pairs(plan.rows, 1))
    whole = pairs(plan.units(page_tokens), page_tokens)
    return sorted(whole + ([] if plan.all_whole else pairs(plan.rest, 1)))


@st.composite
def pages_and_slots(draw, kv_rows: int, num_slots: int, page_tokens: int):
    """[n, page_tokens] KV rows (whole aligned pages, scattered rows, -1 padding, rows out of
    range) and n slots (a run, scattered, -1 or out of range)."""
    n = draw(st.integers(1, 40))
    row = st.one_of(st.integers(0, kv_rows - 1), st.sampled_from([-1, -3, kv_rows, 2**62]))
    pages = []
    for _ in range(n):
        if draw(st.booleans()):
            first = draw(st.integers(0, kv_rows // page_tokens - 1)) * page_tokens
            pages.append([first + t for t in range(page_tokens)])
        else:
            pages.append(draw(st.lists(row, min_size=page_tokens, max_size=page_tokens)))
    if draw(st.booleans()):
        start = draw(st.integers(0, num_slots - n))
        slots = list(range(start, start + n))
    else:
        slots = draw(st.lists(st.one_of(st.integers(0, num_slots - 1),
                                        st.sampled_from([-1, -2, num_slots])),
                              min_size=n, max_size=n))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    if dtype == torch.int32:
        pages = [[min(r, 2**31 - 1) for r in p] for p in pages]
    return torch.tensor(pages, dtype=dtype), torch.tensor(slots, dtype=dtype)


def plan_and_reference(token_pages, slots, kv_rows: int, num_slots: int, page_tokens: int,
                       gathering: bool):
    """The plan of ``token_pages`` and ``slots``, the plan of the row lists they stand for
    (the reference), those row lists (source, destination) and their limits (KV, staging)."""
    plan = plan_page_rows(token_pages, slots, kv_rows, num_slots, kv_is_src=gathering)
    kv, staged = token_pages.reshape(-1), page_rows(slots, page_tokens)
    limits = (kv_rows, num_slots * page_tokens)
    src, dst = (kv, staged) if gathering else (staged, kv)
    reference = plan_rows(src, dst, *(limits if gathering else limits[::-1]), page_tokens)
    return plan, reference, src, dst, limits


@SETTINGS
@given(data=st.data(), page_tokens=st.sampled_from([1, 2, 4, 16]), gathering=st.booleans())
def test_plan_page_rows_moves_what_planning_the_rows_moves(data, page_tokens, gathering):
    kv_rows, num_slots = 64 * page_tokens, 50
    token_pages, slots = data.draw(pages_and_slots(kv_rows, num_slots, page_tokens))
    plan, reference, src, dst, limits = plan_and_reference(token_pages, slots, kv_rows,
                                                           num_slots, page_tokens, gathering)
    assert plan.errors == reference.errors
    # no -1 on either side is claimed exactly where every row and slot is in range (then
    # the duplicate check counts none): claimed wrongly the check only loses its shortcut
    # (it falls back to the sort); not claimed, it makes a needless pass
    in_range = bool(((token_pages >= 0) & (token_pages < kv_rows)).all()) \
        and bool(((slots >= 0) & (slots < num_slots)).all())
    assert plan.no_skips == in_range
    assert moved_pairs(plan, page_tokens) == moved_pairs(reference, page_tokens)
    assert sorted(moved_pairs(plan, page_tokens)) == sorted(
        (s, d) for s, d in zip(src.tolist(), dst.tolist(), strict=True)
        if 0 <= s < limits[not gathering] and 0 <= d < limits[gathering])
    for part in (plan.rows, *((plan.units(page_tokens),) if plan.some_whole else ())):
        for side in ("src", "dst"):  # a run it claims is one
            start = part.run(side)
            if start is not None:
                assert part.values(side).tolist() == list(range(start, start + len(part)))


@SETTINGS
@given(data=st.data(), page_tokens=st.sampled_from([1, 2, 4, 16]), gathering=st.booleans(),
       clean=st.booleans(), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_plan_few_pages_moves_what_plan_page_rows_moves(data, page_tokens, gathering, clean,
                                                        dtype):
    """The list plan of a few pages (whole, scattered; slots a run or not; int64 pages,
    which one-token plans read as they are, and int32) moves the same pairs as the numpy
    plan, and every run it claims is one; it declines (None) only where some row or slot
    is -1 or out of range."""
    kv_rows, num_slots = 64 * page_tokens, 50
    token_pages, slots = data.draw(pages_and_slots(kv_rows, num_slots, page_tokens))
    token_pages = token_pages.to(dtype)
    if clean:  # no -1 and nothing out of range: the plan of few pages must take them
        token_pages = token_pages.clamp(0, kv_rows - 1)
        slots = slots.clamp(0, num_slots - 1)
    n = max(1, SMALL_PLAN_ROWS // page_tokens)
    token_pages, slots = token_pages[:n], slots[:n]
    few = plan_few_pages(token_pages, slots, kv_rows, num_slots, kv_is_src=gathering)
    reference = plan_page_rows(token_pages, slots, kv_rows, num_slots, kv_is_src=gathering)
    valid = (token_pages >= 0).all() and (token_pages < kv_rows).all() \
        and (slots >= 0).all() and (slots < num_slots).all()
    assert (few is not None) == bool(valid)
    if few is None:
        return
    assert few.errors == 0 and few.no_skips
    assert moved_pairs(few, page_tokens) == moved_pairs(reference, page_tokens)
    for part in (few.rows, *((few.units(page_tokens),) if few.some_whole else ())):
        for side in ("src", "dst"):  # a run it claims is one, and none is missed
            start = part.run(side)
            values = part.values(side).tolist()
            if start is not None:
                assert values == list(range(start, start + len(part)))
            elif len(values) > 1:
                assert values != list(range(values[0], values[0] + len(values)))


@pytest.mark.parametrize("cache", ["stacked", "per_layer"])
@SETTINGS
@given(data=st.data(), row_bytes=st.sampled_from(ROW_BYTES),
       page_tokens=st.sampled_from([1, 16]), pages=st.sampled_from([1, 3, 32]))
def test_scattered_pages_gather_and_scatter_the_right_bytes(cache, data, row_bytes, page_tokens,
                                                            pages):
    """Scattered token slots (as top-k evictions give), some -1: gather copies each named
    row into its staging row and leaves the others; scatter writes back only named rows."""
    layers, kv_slots = 3, 600
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    shape = (layers, kv_slots, row_bytes)
    data_kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    kv = kvmove.KVCache({"kv": data_kv if cache == "stacked" else list(data_kv.clone())})
    rows = torch.randperm(kv_slots, generator=g)[:pages * page_tokens]
    rows[torch.rand(rows.shape, generator=g) < 0.1] = -1
    token_pages = rows.reshape(pages, page_tokens)
    slots = torch.randperm(40, generator=g)[:pages]
    staging = kvmove.StagingBuffer(kv, num_slots=40, page_tokens=page_tokens)
    staged = staging.tensor("kv").view(layers, 40 * page_tokens, row_bytes)
    staged.copy_(torch.randint(0, 256, staged.shape, dtype=torch.uint8, generator=g))
    before = staged.clone()
    kvmove.gather(kv, staging, token_pages, slots)
    want = before.clone()
    for p, slot in enumerate(slots.tolist()):
        for t, r in enumerate(token_pages[p].tolist()):
            if r >= 0:
                want[:, slot * page_tokens + t] = torch.stack(
                    [kv.layer("kv", i)[r] for i in range(layers)])
    assert torch.equal(staged, want)
    # Back into another cache: only named rows change.
    other = kvmove.KVCache({"kv": [torch.zeros(kv_slots, row_bytes, dtype=torch.uint8)
                                   for _ in range(layers)]})
    kvmove.scatter(staging, slots, other, token_pages)
    expect = torch.zeros(shape, dtype=torch.uint8)
    for p, slot in enumerate(slots.tolist()):
        for t, r in enumerate(token_pages[p].tolist()):
            if r >= 0:
                expect[:, r] = staged[:, slot * page_tokens + t]
    assert torch.equal(torch.stack([other.layer("kv", i) for i in range(layers)]), expect)
    staging.close()


def test_checks_of_scattered_pages_raise_before_writing():
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 100, 132), dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    before = staging.tensor("kv").clone()
    with pytest.raises(IndexError, match=r"token_pages\[5\] = 100"):
        kvmove.gather(kv, staging, [[7, 3, 9, 1], [2, 100, 5, 6]], [0, 1])
    with pytest.raises(IndexError, match="slots"):
        kvmove.gather(kv, staging, [[7, 3, 9, 1]], [4])
    with pytest.raises(ValueError, match="slots"):  # a slot named twice
        kvmove.gather(kv, staging, [[7, 3, 9, 1], [2, 8, 5, 6]], [1, 1])
    assert torch.equal(staging.tensor("kv"), before)
    with pytest.raises(ValueError, match="token_pages"):  # a KV row written twice
        kvmove.scatter(staging, [0, 1], kv, [[7, 3, 9, 1], [2, 3, 5, 6]])
    kvmove.gather(kv, staging, [[7, 3, 9, 1], [2, 3, 5, 6]], [0, 1])  # read twice: fine
    errors = kvmove.gather(kv, staging, [[7, 300, 9, 1]], [2], check=False)
    assert int(errors) == 1  # skipped and counted
    staging.close()


@st.composite
def paged_pages(draw, kv_pages: int, page_tokens: int, num_slots: int):
    """Pages of a paged KV cache (each the aligned run of a KV page) and their slots, as the
    plan's fast test of whole pages sees them, with at most one page spoiled: shifted off
    its alignment, two rows swapped, one row moved by a page, one row -1, or one row out of
    range; slots a run or scattered (distinct or not)."""
    n = draw(st.integers(1, min(kv_pages, 40)))
    pages = draw(st.lists(st.integers(0, kv_pages - 1), min_size=n, max_size=n, unique=True))
    rows = [[p * page_tokens + t for t in range(page_tokens)] for p in pages]
    spoil = draw(st.sampled_from(["none", "shift", "swap", "row", "skip", "out"]))
    i = draw(st.integers(0, n - 1))
    t = draw(st.integers(0, page_tokens - 1))
    if spoil == "shift" and rows[i][-1] + 1 < kv_pages * page_tokens:
        rows[i] = [r + 1 for r in rows[i]]  # a run, not aligned
    elif spoil == "swap" and page_tokens > 1:
        u = (t + 1) % page_tokens
        rows[i][t], rows[i][u] = rows[i][u], rows[i][t]
    elif spoil == "row":
        rows[i][t] = (rows[i][t] + page_tokens) % (kv_pages * page_tokens)
    elif spoil == "skip":
        rows[i][t] = -1
    elif spoil == "out":
        rows[i][t] = kv_pages * page_tokens
    if draw(st.booleans()):
        start = draw(st.integers(0, num_slots - n))
        slots = list(range(start, start + n))
    else:
        slots = draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(rows, dtype=dtype), torch.tensor(slots, dtype=dtype)


@SETTINGS
@given(data=st.data(), page_tokens=st.sampled_from([2, 4, 16, 64]), gathering=st.booleans())
def test_plan_of_paged_pages_finds_whole_pages_as_planning_the_rows_does(data, page_tokens,
                                                                        gathering):
    """Whole pages (the flat test of aligned runs) and the distinct destinations the plan
    claims: as the row lists' plan finds them, one spoiled page or none."""
    kv_pages, num_slots = 48, 50
    kv_rows = kv_pages * page_tokens
    token_pages, slots = data.draw(paged_pages(kv_pages, page_tokens, num_slots))
    plan, reference, *_ = plan_and_reference(token_pages, slots, kv_rows, num_slots,
                                             page_tokens, gathering)
    assert plan.errors == reference.errors
    assert plan.all_whole == reference.all_whole
    assert moved_pairs(plan, page_tokens) == moved_pairs(reference, page_tokens)
    if plan.distinct_dst:  # no destination row named twice
        rows = plan.rows.dst.tolist()
        assert len(set(rows)) == len(rows)
    slot_list = slots.tolist()
    one_run = slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list)))
    kept_all = bool(((token_pages >= 0) & (token_pages < kv_rows)).all())
    # claimed where it is known at no cost: a gather into one run of slots, nothing dropped
    assert plan.distinct_dst == (gathering and one_run and kept_all)


@pytest.mark.parametrize("cache", ["stacked", "per_layer"])
@SETTINGS
@given(data=st.data(), row_bytes=st.sampled_from(ROW_BYTES),
       page_tokens=st.sampled_from([4, 16]))
def test_paged_pages_gather_and_scatter_the_right_bytes(cache, data, row_bytes, page_tokens):
    """Pages of a paged KV cache, one maybe spoiled (-1, a moved or swapped row, off its
    alignment): gather and scatter move exactly the named rows, for odd row sizes."""
    layers, kv_pages, num_slots = 3, 24, 30
    kv_rows = kv_pages * page_tokens
    token_pages, slots = data.draw(paged_pages(kv_pages, page_tokens, num_slots))
    token_pages = token_pages.clamp(-1, kv_rows - 1)  # no bad index: checks would raise
    n = token_pages.shape[0]
    if len(set(slots.tolist())) < n:  # a gather's slots are distinct
        slots = torch.arange(n, dtype=slots.dtype)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    shape = (layers, kv_rows, row_bytes)
    data_kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    kv = kvmove.KVCache({"kv": data_kv if cache == "stacked" else list(data_kv.clone())})
    staging = kvmove.StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens)
    staged = staging.tensor("kv").view(layers, num_slots * page_tokens, row_bytes)
    staged.copy_(torch.randint(0, 256, staged.shape, dtype=torch.uint8, generator=g))
    want = staged.clone()
    kvmove.gather(kv, staging, token_pages, slots)
    named = [(slot * page_tokens + t, r) for p, slot in enumerate(slots.tolist())
             for t, r in enumerate(token_pages[p].tolist()) if r >= 0]
    for s, r in named:
        want[:, s] = data_kv[:, r]
    assert torch.equal(staged, want)
    written = [r for _, r in named]
    if len(set(written)) == len(written):  # scatter: a KV row written once
        other = kvmove.KVCache({"kv": [torch.zeros(kv_rows, row_bytes, dtype=torch.uint8)
                                       for _ in range(layers)]})
        kvmove.scatter(staging, slots, other, token_pages)
        expect = torch.zeros(shape, dtype=torch.uint8)
        for s, r in named:
            expect[:, r] = staged[:, s]
        assert torch.equal(torch.stack([other.layer("kv", i) for i in range(layers)]), expect)
    staging.close()


@pytest.mark.parametrize("slots", [[-1, 0, 1], [48, 49, 50], [-2, -1], [49, 50]])
@pytest.mark.parametrize("page_tokens", [1, 4])
def test_plan_few_pages_declines_a_run_of_slots_that_leaves_the_staging(slots, page_tokens):
    """A run of slots is range-checked by its ends: a run starting at -1 or ending past the
    staging is left to plan_page_rows (which skips and counts), as any other bad slot."""
    n, num_slots = len(slots), 50
    token_pages = torch.arange(n * page_tokens).reshape(n, page_tokens)
    assert plan_few_pages(token_pages, torch.tensor(slots), 64 * page_tokens, num_slots,
                          kv_is_src=True) is None
