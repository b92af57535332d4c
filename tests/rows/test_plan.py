"""The torch backend's plan of a copy (kvmove/rows/plan.py) on its own: which rows it moves
(skips dropped, out-of-range rows dropped and counted), which of them form whole pages and
in what units, and where a side is one run. Every plan is compared with a plain Python
reading of the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.plan import (
    SMALL_PLAN_ROWS,
    Part,
    _run_start,
    plan_rows,
    plan_whole_pages,
    unit_tokens,
)
from tests.support.caches import assert_same, make_layers, snapshot

SETTINGS = settings(max_examples=60, deadline=None)


def pairs_of(part: Part, unit: int) -> list[tuple[int, int]]:
    """The (src row, dst row) pairs a part moves in units of ``unit`` rows."""
    return [(s * unit + t, d * unit + t) for s, d in zip(part.src.tolist(), part.dst.tolist(),
                                                         strict=True) for t in range(unit)]


def expected_pairs(src: list[int], dst: list[int], src_limit: int, dst_limit: int):
    """The pairs a copy moves and the rows it counts as out of range, read plainly."""
    moved, errors = [], 0
    for s, d in zip(src, dst, strict=True):
        if s < -1 or s >= src_limit or d < -1 or d >= dst_limit:
            errors += 1
        elif s >= 0 and d >= 0:
            moved.append((s, d))
    return moved, errors


def test_part_values_from_lists_runs_and_tensors():
    part = Part([4, 5, 6], [9, 2, 3])
    assert len(part) == 3
    assert part.src.dtype == np.int64 and part.src.tolist() == [4, 5, 6]
    assert part.run("src") == 4 and part.run("dst") is None
    t = part.tensor("dst", torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [9, 2, 3]
    assert part.tensor("dst", torch.device("cpu")) is t  # made once
    # Runs the planner already knows are taken as given (the values are not read).
    known = Part([7], [1], runs={"src": 7, "dst": 1})
    assert known.run("src") == 7 and known.run("dst") == 1


@pytest.mark.parametrize(("rows", "start"), [
    ([], None), ([3], 3), ([3, 4], 3), ([3, 5], None), ([0, 1, 2, 3], 0), ([1, 2, 4, 3], None),
    ([5, 6, 5, 8], None), ([-1, 0, 1], -1),
    # from first to first + n - 1, yet one step repeats a value and another skips one
    ([0, 1, 1, 3], None), ([4, 4, 6], None), ([0, 2, 2, 3], None),
])
def test_run_start(rows, start):
    assert _run_start(np.array(rows, dtype=np.int64)) == start


def test_unit_tokens_fit_16_kib_and_divide_the_page():
    assert unit_tokens(64, 656) == 16 and unit_tokens(16, 4100) == 2
    assert unit_tokens(64, 132) == 64 and unit_tokens(8, 20000) == 1
    assert unit_tokens(1, 656) == 1 and unit_tokens(12, 4096) == 4  # 4 divides 12


def test_whole_aligned_pages_move_as_units():
    pt = 4
    src = torch.tensor([8, 9, 10, 11, 1, 2, 3, 4, 12, 13, -1, -1, 0, 1, 2, 3, 16, 17, 18, 19])
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    plan = plan_rows(src, dst, 18, 20, pt)  # KV rows 16.. are out of range
    # Page 0 and 3 are whole aligned runs on both sides; page 1 is unaligned in the KV,
    # page 2 is cut short, page 4 is past the KV.
    assert plan.some_whole and not plan.all_whole
    assert plan.errors == 2  # rows 18 and 19; 16 and 17 are in range
    assert plan.units(4).src.tolist() == [2, 0] and plan.units(4).dst.tolist() == [0, 3]
    assert plan.units(2).src.tolist() == [4, 5, 0, 1]
    assert plan.units(2).dst.tolist() == [0, 1, 6, 7]
    assert plan.rest.src.tolist() == [1, 2, 3, 4, 12, 13, 16, 17]
    assert plan.rest.dst.tolist() == [4, 5, 6, 7, 8, 9, 16, 17]
    assert plan.rows.src.tolist() == [8, 9, 10, 11, 1, 2, 3, 4, 12, 13, 0, 1, 2, 3, 16, 17]
    [s, d] = plan.pages
    assert s.tolist() == [2, 0] and d.tolist() == [0, 3]


@SETTINGS
@given(data=st.data(), page_tokens=st.sampled_from([1, 2, 3, 4, 8]),
       src_limit=st.integers(1, 40), dst_limit=st.integers(1, 40))
def test_plan_rows_moves_exactly_the_valid_pairs(data, page_tokens, src_limit, dst_limit):
    """Whatever the rows (skips, out of range on either side, whole pages or not), the plan's
    whole pages and rest together move exactly the in-range pairs, once each; whole pages
    are aligned runs on both sides; out-of-range rows are counted."""
    n = data.draw(st.integers(0, 6)) * page_tokens
    row = st.integers(-3, max(src_limit, dst_limit) + 3)
    if data.draw(st.booleans()) and n:  # mostly whole pages: the case the plan is for
        pages = data.draw(st.lists(st.integers(-1, src_limit // page_tokens + 1),
                                   min_size=n // page_tokens, max_size=n // page_tokens))
        src = [p * page_tokens + t if p >= 0 else -1 for p in pages for t in range(page_tokens)]
    else:
        src = data.draw(st.lists(row, min_size=n, max_size=n))
    dst = data.draw(st.one_of(
        st.lists(row, min_size=n, max_size=n),
        st.just(list(range(n))),  # fresh staging slots: one run
    ))
    plan = plan_rows(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int32),
                     src_limit, dst_limit, page_tokens)
    moved, errors = expected_pairs(src, dst, src_limit, dst_limit)
    assert plan.errors == errors
    assert sorted(pairs_of(plan.rows, 1)) == sorted(moved)
    if not plan.some_whole:
        assert plan.pages is None and not plan.all_whole
        return
    whole = pairs_of(plan.units(page_tokens), page_tokens)
    assert sorted(whole + pairs_of(plan.rest, 1)) == sorted(moved)
    if plan.all_whole:  # (a plan of some whole pages may drop every other row)
        assert len(plan.rest) == 0
    for unit in (u for u in range(1, page_tokens + 1) if page_tokens % u == 0):
        assert sorted(pairs_of(plan.units(unit), unit)) == sorted(whole)
    for s, d in zip(*plan.pages, strict=True):  # in range on both sides
        assert (s + 1) * page_tokens <= src_limit and (d + 1) * page_tokens <= dst_limit


@SETTINGS
@given(data=st.data(), page_tokens=st.sampled_from([1, 2, 16, 64]),
       gathering=st.booleans(), big=st.booleans())
def test_plan_whole_pages_agrees_with_plan_rows(data, page_tokens, gathering, big):
    """From pages (no row lists): the same rows, pages and runs as planning the rows, on
    both of its paths (a few pages in Python, many in numpy); None where some page is not
    whole (-1 padding, unaligned, out of range) or a slot is out of range."""
    kv_pages_n, num_slots = 600, 700
    kv_rows = kv_pages_n * page_tokens
    n = data.draw(st.integers(SMALL_PLAN_ROWS // page_tokens + 1, 300) if big
                  else st.integers(1, max(1, SMALL_PLAN_ROWS // page_tokens)))
    if data.draw(st.booleans()):  # consecutive pages into consecutive slots: runs
        first, slot0 = data.draw(st.integers(0, kv_pages_n - n)), data.draw(
            st.integers(0, num_slots - n))
        pages, slots = list(range(first, first + n)), list(range(slot0, slot0 + n))
    else:
        pages = data.draw(st.lists(st.integers(0, kv_pages_n - 1), min_size=n, max_size=n))
        slots = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n))
    token_pages = [[p * page_tokens + t for t in range(page_tokens)] for p in pages]
    spoil = data.draw(st.sampled_from(["none", "none", "pad", "shift", "page", "slot"]))
    i = data.draw(st.integers(0, n - 1))
    if spoil == "pad":
        token_pages[i][-1] = -1
    elif spoil == "shift" and page_tokens > 1:
        token_pages[i] = [r + 1 for r in token_pages[i]]
    elif spoil == "page":
        token_pages[i] = [kv_rows + t for t in range(page_tokens)]
    elif spoil == "slot":
        slots[i] = data.draw(st.sampled_from([-1, -5, num_slots]))
    spoilt = spoil != "none" and not (spoil == "shift" and page_tokens == 1)
    tp = torch.tensor(token_pages, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    sl = torch.tensor(slots, dtype=torch.int64)
    plan = plan_whole_pages(tp, sl, kv_rows, num_slots, kv_is_src=gathering)
    if spoilt:
        assert plan is None
        return
    assert plan is not None and plan.all_whole and plan.errors == 0
    kv_side = torch.tensor(token_pages).reshape(-1)
    st_side = (torch.tensor(slots)[:, None] * page_tokens + torch.arange(page_tokens)).reshape(-1)
    src, dst = (kv_side, st_side) if gathering else (st_side, kv_side)
    reference = plan_rows(src, dst, *((kv_rows, num_slots * page_tokens) if gathering
                                      else (num_slots * page_tokens, kv_rows)), page_tokens)
    assert plan.rows.src.tolist() == src.tolist() and plan.rows.dst.tolist() == dst.tolist()
    want_src, want_dst = (pages, slots) if gathering else (slots, pages)
    assert plan.pages[0].tolist() == want_src and plan.pages[1].tolist() == want_dst
    if page_tokens > 1:
        assert [x.tolist() for x in plan.pages] == [x.tolist() for x in reference.pages]
    for unit in (1, page_tokens):
        for side in ("src", "dst"):
            assert plan.units(unit).run(side) == _run_start(plan.units(unit).values(side))


def test_plan_whole_pages_refuses_device_and_empty_indices():
    assert plan_whole_pages(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                            64, 4, kv_is_src=True) is None
    meta = torch.zeros(1, 4, dtype=torch.int64, device="meta")
    assert plan_whole_pages(meta, torch.zeros(1, dtype=torch.int64), 64, 4, kv_is_src=True) is None


@pytest.mark.parametrize("pages", [SMALL_PLAN_ROWS // 4, 3 * SMALL_PLAN_ROWS])
@pytest.mark.parametrize("page_tokens", [1, 4])
def test_a_destination_that_only_looks_like_a_run_is_refused(pages, page_tokens):
    """Destinations from ``first`` to ``first + n - 1`` with one value named twice (and one
    left out) are no run: the gather and the scatter refuse them, in the list plan and the
    numpy plan, and write nothing."""
    kv = kvmove.KVCache({"kv": make_layers(2, 4 * pages * page_tokens, 132, torch.uint8,
                                           seed=3)})
    staging = kvmove.StagingBuffer(kv, num_slots=pages + 2, page_tokens=page_tokens)
    near_run = list(range(1, pages + 1))
    near_run[pages // 2] = near_run[pages // 2 - 1]  # ..., k, k, k + 2, ...
    far = torch.randperm(4 * pages, generator=torch.Generator().manual_seed(0))[:pages]
    token_pages = far[:, None] * page_tokens + torch.arange(page_tokens)
    before_st, before_kv = snapshot(staging), snapshot(kv)
    with pytest.raises(ValueError, match="more than once"):
        kvmove.gather(kv, staging, token_pages, torch.tensor(near_run), backend="torch")
    assert_same(before_st, snapshot(staging))
    pages_near = torch.tensor(near_run)[:, None] * page_tokens + torch.arange(page_tokens)
    with pytest.raises(ValueError, match="more than once"):
        kvmove.scatter(staging, torch.arange(pages), kv, pages_near, backend="torch")
    assert_same(before_kv, snapshot(kv))
