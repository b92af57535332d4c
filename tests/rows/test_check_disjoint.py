"""check_disjoint: a copy within one pool refuses exactly the rows it would both read and
write (``-1`` excepted)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvmove.rows.moves import check_disjoint


@given(st.lists(st.integers(-1, 20), max_size=30), st.lists(st.integers(-1, 20), max_size=30))
def test_check_disjoint_refuses_exactly_a_row_both_name(src, dst):
    _check_disjoint_against_sets(src, dst)


@given(st.lists(st.integers(-1, 10**6), max_size=40), st.lists(st.integers(-1, 10**6),
                                                                  max_size=40))
def test_check_disjoint_on_rows_spread_far_apart(src, dst):
    _check_disjoint_against_sets(src, dst + src[:1])  # shares a row when src has one


def _check_disjoint_against_sets(src, dst):
    shared = {r for r in src if r >= 0} & {r for r in dst if r >= 0}
    a, b = torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
    if not shared:
        check_disjoint(a, b)
        return
    with pytest.raises(ValueError, match=r"both name row \d+ ") as e:
        check_disjoint(a, b)
    assert int(str(e.value).split("both name row ")[1].split()[0]) in shared


def test_check_disjoint():
    check_disjoint(torch.tensor([0, 1, -1]), torch.tensor([2, -1, 3]))
    with pytest.raises(ValueError, match="both name row 1"):
        check_disjoint(torch.tensor([0, 1]), torch.tensor([1, 2]))
