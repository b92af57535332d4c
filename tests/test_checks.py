"""kvmove.checks on its own: each check accepts what the API allows, and refuses the rest with
the named exception, naming the argument and the first bad value."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvmove import checks

ROOT = Path(__file__).resolve().parent.parent


def test_as_index_tensor_takes_tensors_and_lists_of_ints():
    t = torch.tensor([3, -1], dtype=torch.int32)
    assert checks.as_index_tensor(t, "rows", dim=1) is t
    got = checks.as_index_tensor([[1, 2], [3, 4]], "pages", dim=2)
    assert got.dtype == torch.int64 and got.tolist() == [[1, 2], [3, 4]]
    assert checks.as_index_tensor([], "rows", dim=1).shape == (0,)
    assert checks.as_index_tensor([], "pages", dim=2).shape == (0, 0)


def test_as_index_tensor_takes_numpy_int_arrays():
    a = np.array([[3, -1]], dtype=np.int32)
    got = checks.as_index_tensor(a, "pages", dim=2)
    assert got.dtype == torch.int32 and got.tolist() == [[3, -1]]
    a[0, 0] = 7  # shares the array's memory, as torch.from_numpy does
    assert got[0, 0] == 7
    frozen = np.array([1, 2], dtype=np.int64)
    frozen.flags.writeable = False  # a read-only array is copied (torch warns otherwise)
    assert checks.as_index_tensor(frozen, "rows", dim=1).tolist() == [1, 2]
    backwards = np.arange(4, dtype=np.int64)[::-1]  # torch has no negative strides: copied
    assert checks.as_index_tensor(backwards, "rows", dim=1).tolist() == [3, 2, 1, 0]
    columns = np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2]  # a view with a gap
    assert checks.as_index_tensor(columns, "pages", dim=2).tolist() == [[0, 2], [3, 5]]


@pytest.mark.parametrize(("value", "error", "match"), [
    (np.array([1.0]), TypeError, "rows must be int32 or int64, got dtype float64"),
    (np.array([1], dtype=np.uint64), TypeError, "uint64"),
    (np.array([[1]]), ValueError, "rows must have 1 dimension"),
    (torch.tensor([1.0]), TypeError, "rows must be int32 or int64"),
    (torch.tensor([1], dtype=torch.int16), TypeError, "int16"),
    (torch.tensor([[1]]), ValueError, "1 dimension"),
    ([1.5], TypeError, "rows must hold integers"),
    ([True], TypeError, "rows must hold integers"),
    ("12", TypeError, "rows must be an int32/int64 tensor"),
    ([2**70], ValueError, "rows is not a valid index list"),
])
def test_as_index_tensor_refuses(value, error, match):
    with pytest.raises(error, match=match):
        checks.as_index_tensor(value, "rows", dim=1)


def test_check_range_names_the_first_bad_entry():
    checks.check_range(torch.tensor([-1, 0, 9]), 10, "rows")
    with pytest.raises(IndexError, match=r"rows\[2\] = 10 is out of range"):
        checks.check_range(torch.tensor([0, 1, 10, 11]), 10, "rows")
    with pytest.raises(IndexError, match=r"rows\[1\] = -2"):
        checks.check_range(torch.tensor([0, -2]), 10, "rows")
    checks.check_range(torch.zeros(0, dtype=torch.int64), 0, "rows")


def test_check_unique_ignores_skips_and_names_the_repeated_row():
    checks.check_unique(torch.tensor([-1, -1, 3, 1]), "rows")
    with pytest.raises(ValueError, match="names row/slot 3 more than once"):
        checks.check_unique(torch.tensor([3, 1, 3]), "rows")
    with pytest.raises(ValueError, match="names row/slot 8 more than once"):
        checks.check_unique(np.array([2, 2]), "pages", page_tokens=4)
    # a list (a few pages of a plan made in Python): the same answers
    checks.check_unique([-1, -1, 3, 1], "rows")
    checks.check_unique([5, 0, 2], "rows")
    with pytest.raises(ValueError, match="names row/slot 3 more than once"):
        checks.check_unique([3, 1, 3], "rows")
    with pytest.raises(ValueError, match="names row/slot 8 more than once"):
        checks.check_unique([2, 0, 2], "pages", page_tokens=4)


@given(st.lists(st.integers(-3, 40), max_size=60))
def test_has_repeats_says_whether_a_value_occurs_twice(values):
    assert checks.has_repeats(np.array(values, dtype=np.int64)) == (
        len(set(values)) != len(values))


def test_the_checks_import_nothing_on_their_first_call():
    # np.unique, np.intersect1d and np.isin (on rows spread far apart) import numpy.ma on
    # their first call in a process: 4-10 ms inside whatever call made it.
    script = textwrap.dedent("""
        import sys
        import numpy as np, torch
        from kvmove import checks
        from kvmove.rows.moves import check_disjoint
        before = set(sys.modules)
        rows = torch.arange(0, 64_000, 1000)
        check_disjoint(rows, rows + 1)
        checks.has_repeats(np.arange(50) * 977)
        checks.check_unique(rows.flip(0), "rows")
        print(sorted(set(sys.modules) - before))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=True)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("value", [[1, 2], (1, 2), np.array([1, 2], dtype=np.uint8),
                                   torch.tensor([1, 2], dtype=torch.int32)])
def test_as_int_array_accepts_integer_sequences(value):
    got = checks.as_int_array(value, "slots")
    assert got.dtype == np.int64 and got.tolist() == [1, 2]


@pytest.mark.parametrize(("value", "error"), [
    ([1.0], TypeError), (["a"], TypeError), ("12", TypeError), ([[1]], ValueError),
    (torch.tensor([True]), TypeError), (np.array([2**64 - 1], dtype=np.uint64), TypeError),
])
def test_as_int_array_refuses(value, error):
    with pytest.raises(error, match="slots"):
        checks.as_int_array(value, "slots")


def test_check_positive_int_and_layout():
    assert checks.check_positive_int(np.int64(3), "n") == 3
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ValueError, match=r"n must be a positive int"):
            checks.check_positive_int(bad, "n")
    assert checks.check_layout("a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"layout must be one of \('a', 'b'\), got 'c'"):
        checks.check_layout("c", ("a", "b"))


def test_check_keys():
    assert checks.check_keys(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match="wrap a single key in a list"):
        checks.check_keys("abc")
    with pytest.raises(TypeError, match=r"keys\[1\] must be a str"):
        checks.check_keys(["a", 1])
    with pytest.raises(ValueError, match=r"keys\[1\] is an empty string"):
        checks.check_keys(["a", ""])
    with pytest.raises(ValueError, match=r"keys\[2\] = 'a' repeats"):
        checks.check_keys(["a", "b", "a"])
    assert checks.check_keys(["a", "a"], unique=False) == ["a", "a"]


def test_check_valid_tokens():
    assert checks.check_valid_tokens(None, 2, 8).tolist() == [8, 8]
    assert checks.check_valid_tokens(3, 2, 8).tolist() == [3, 3]
    assert checks.check_valid_tokens(torch.tensor(5), 1, 8).tolist() == [5]
    assert checks.check_valid_tokens([1, 8], 2, 8).tolist() == [1, 8]
    # None and one int give one read-only array per (keys, tokens), shared between calls.
    shared = checks.check_valid_tokens(None, 3, 8)
    assert shared is checks.check_valid_tokens(8, 3, 8) and not shared.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        shared[0] = 1
    assert checks.check_valid_tokens([1, 8], 2, 8).flags.writeable  # the caller's, copied
    for bad, error in ((0, ValueError), (9, ValueError), (2.0, TypeError), (True, TypeError),
                       ([1], ValueError), ([1, 0], ValueError), (torch.tensor(1.0), TypeError)):
        with pytest.raises(error, match="valid_tokens"):
            checks.check_valid_tokens(bad, 2, 8)


@given(st.lists(st.integers(-2, 40), max_size=300), st.sampled_from([1, 2, 4, 16]),
       st.integers(1, 12), st.sampled_from([torch.int32, torch.int64]))
def test_page_numbers_of_a_few_tensor_indices_agree_with_numpy(idx, page_tokens, num_pages,
                                                               dtype):
    """A few indices in a tensor are checked in Python ints: the same pages, or the same
    error, as the numpy path gives for the same values."""
    def outcome(value, **kwargs):
        try:
            pages = checks.page_numbers(value, page_tokens, num_pages, "idx", **kwargs)
        except (ValueError, IndexError) as e:
            return type(e), str(e)
        return list(pages) if isinstance(pages, list) else pages.tolist()

    expected = outcome(np.array(idx, dtype=np.int64))
    assert outcome(torch.tensor(idx, dtype=dtype)) == expected
    assert outcome(torch.tensor(idx, dtype=dtype), few_as_list=True) == expected
    if not isinstance(expected, tuple):  # without few_as_list: an int64 array, as ever
        pages = checks.page_numbers(torch.tensor(idx, dtype=dtype), page_tokens, num_pages,
                                    "idx")
        assert isinstance(pages, np.ndarray) and pages.dtype == np.int64


def test_page_numbers():
    assert checks.page_numbers(np.arange(8, 16), 4, 4, "idx").tolist() == [2, 3]
    with pytest.raises(ValueError, match="not a whole number of pages"):
        checks.page_numbers(np.arange(6), 4, 4, "idx")
    with pytest.raises(ValueError, match=r"idx\[4\] = 5 does not start a page"):
        checks.page_numbers([0, 1, 2, 3, 5, 6, 7, 8], 4, 4, "idx")
    with pytest.raises(IndexError, match=r"idx\[0\] = 16 is page 4, outside the pool's 4"):
        checks.page_numbers(np.arange(16, 20), 4, 4, "idx")


@given(st.lists(st.integers(-3, 12), max_size=40), st.integers(1, 12), st.booleans())
def test_small_rows_ok_agrees_with_the_full_checks(rows, limit, unique):
    a = np.array(rows, dtype=np.int64).reshape(-1, 1) if rows else np.zeros((0, 1), np.int64)
    if not rows:
        return
    try:
        checks.check_range(torch.from_numpy(a), limit, "rows")
        if unique:
            checks.check_unique(torch.from_numpy(a), "rows")
        full = True
    except (IndexError, ValueError):
        full = False
    assert checks.small_rows_ok(a, limit, unique=unique) == full
    big = np.zeros(checks.SMALL_ROWS + 1, dtype=np.int64)
    assert checks.small_rows_ok(big, limit, unique=False) is False  # left to numpy


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), 1e10, True, "1", None])
def test_check_seconds_refuses_waits_a_thread_cannot_make(value):
    with pytest.raises(ValueError, match="call_timeout"):
        checks.check_seconds(value, "call_timeout")


def test_check_seconds_accepts_what_it_says():
    assert checks.check_seconds(2, "t") == 2.0
    assert checks.check_seconds(0, "t", zero_ok=True) == 0.0
    assert checks.check_seconds(None, "t", none_ok=True) is None
    with pytest.raises(ValueError, match="or None"):
        checks.check_seconds(float("inf"), "t", none_ok=True)


@given(values=st.lists(st.integers(-1, 40), max_size=60), extra=st.integers(0, 2000))
def test_check_unique_with_a_bound_agrees_with_the_sort(values, extra):
    """Values known to be -1 or below ``limit``: the table of flags (small limits) and the
    sort (large ones) accept and refuse the same rows, naming the same first repeat."""
    rows = np.array(values, dtype=np.int64)
    try:
        checks.check_unique(rows, "rows")
        expected = None
    except ValueError as e:
        expected = str(e)
    # skips=False: no -1 (the caller saw none), so the table counts none
    for limit, skips in ((41, True), (41 + extra, True), (41, -1 in values)):
        try:
            checks.check_unique(rows, "rows", limit=limit, skips=skips)
            got = None
        except ValueError as e:
            got = str(e)
        assert got == expected
