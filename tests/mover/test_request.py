"""``RequestTaker.take``: a call's arguments are validated once, at the call, and taken
(copied) before anything moves. No store: the taker knows the mover's geometry only."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kvmove.errors import KVMoveError
from kvmove.mover.request import Request, RequestTaker

PT = 4
SLOTS = 32


def taker(*, check: bool = True, closed: bool = False) -> RequestTaker:
    return RequestTaker(life=types.SimpleNamespace(closed=closed), device=torch.device("cpu"),
                        page_tokens=PT, num_slots=SLOTS, check=check, evict_stream=None,
                        prefetch_stream=None)


def test_a_request_copies_the_indices_and_the_valid_tokens():
    pages = np.arange(8, dtype=np.int64).reshape(2, PT)
    valid = np.array([4, 2])
    r = taker().take(["a", "b"], pages, valid, True)
    pages[:] = -1
    valid[:] = 0
    assert r.keys == ["a", "b"] and r.pages.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert r.valid.tolist() == [4, 2] and r.bad is None and r.ordered is None
    tensor = torch.arange(8).reshape(2, PT)
    r = taker().take(["a", "b"], tensor, None, False, layerwise=True)
    tensor.fill_(-1)
    assert isinstance(r.pages, np.ndarray) and r.pages.dtype == np.int64
    assert r.pages.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and r.layerwise


def test_evict_options_are_checked_and_kept():
    t = taker()
    pages = torch.arange(PT).reshape(1, PT)
    with pytest.raises(TypeError, match="wait_for_staging must be a bool"):
        t.take(["a"], pages, None, True, wait_for_staging=0)
    with pytest.raises(TypeError, match="detect_exists must be None or a bool, got 0"):
        t.take(["a"], pages, None, True, detect_exists=0)
    r = t.take(["a"], pages, None, True, detect_exists=False, wait_for_staging=False)
    assert r.put_options == {"detect_exists": False} and not r.wait_for_staging
    assert t.take(["a"], pages, None, True).put_options == {}


@pytest.mark.parametrize(("keys", "pages", "error", "match"), [
    (["a", "b"], torch.arange(PT).reshape(1, PT), ValueError, "1 pages for 2 keys"),
    (["a"], torch.arange(2 * PT).reshape(1, 2 * PT), ValueError, "tokens per page"),
    (["a"], torch.tensor([[0, 1, 2, SLOTS]]), IndexError, "token_pages"),
    (["a", "a"], torch.arange(2 * PT).reshape(2, PT), ValueError, "keys"),
])
def test_bad_arguments_raise_at_the_call(keys, pages, error, match):
    with pytest.raises(error, match=match):
        taker().take(keys, pages, None, True)


def test_a_prefetch_refuses_a_repeated_destination_an_evict_does_not():
    pages = torch.tensor([[0, 1, 2, 3], [3, 4, 5, 6]])
    with pytest.raises(ValueError, match="token_pages"):
        taker().take(["a", "b"], pages, None, False)
    assert taker().take(["a", "b"], pages, None, True).bad is None


def test_without_check_out_of_range_rows_mark_their_key():
    r = taker(check=False).take(["a", "b"], torch.tensor([[0, 1, 2, 3], [4, SLOTS, -1, -1]]),
                                None, True)
    assert r.bad.tolist() == [False, True]
    piece = r.piece(1, 2)
    assert isinstance(piece, Request) and piece.keys == ["b"] and piece.bad.tolist() == [True]


def test_device_pages_are_range_checked_where_the_work_runs():
    """Device pages carry the row limit: the mover's stream makes their ``bad`` mask
    (``check_on_device``), or the put job reads it off the pages fetched to the host; the
    caller's thread runs no check kernel. Shown here on CPU tensors (the same tensor ops)."""
    pages = torch.tensor([[0, 1, 2, 3], [4, SLOTS, -1, -1], [5, 6, -2, 7]])
    r = Request(["a", "b", "c"], pages, np.full(3, PT), None, limit=SLOTS)
    piece = r.piece(1, 3)
    assert piece.limit == SLOTS and piece.bad is None
    piece.check_on_device()
    assert piece.bad.tolist() == [True, True]
    r.fetch_pages()  # what the gather enqueues for the put job
    assert r.bad_on_host().tolist() == [False, True, True]
    ok = Request(["a"], pages[:1], np.full(1, PT), None, limit=SLOTS)
    ok.fetch_pages()
    assert ok.bad_on_host() is None
    ok.check_on_device()
    assert ok.bad.tolist() == [False]


def test_a_closed_mover_refuses_the_call():
    with pytest.raises(KVMoveError, match="closed"):
        taker(closed=True).take(["a"], torch.arange(PT).reshape(1, PT), None, True)
