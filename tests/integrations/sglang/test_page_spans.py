"""The one-span-per-object fast path of kvmove's SGLang backend (``PageSpans``): for every pool
kind and layout it serves, its descriptors are span for span those of the general describe
(``describe_trusted`` per component, then ``concat``) and point at the bytes SGLang's own
``get_page_buffer_meta`` names; bad host indices still raise the general check's errors, and
only MLA ``layer_first`` (one span per layer) has no fast path. The bytes that move through
it are checked end to end in test_interop.py and test_interop_random.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.sglang.conftest import indexer_pool, mha_pool, mla_pool

TOKENS = 64  # host pool slots (the pool helpers halve this for the device side)


def _views(kind: str, layout: str, page_size: int):
    from kvmove.integrations.sglang.pools import indexer_view, kv_view

    if kind == "mla":
        pool = mla_pool(layout, page_size=page_size, tokens=TOKENS, seed=1)
        return pool, kv_view(pool, is_mla=True)
    if kind == "mha":
        pool = mha_pool(layout, page_size=page_size, tokens=TOKENS, seed=2)
        return pool, kv_view(pool, is_mla=False)
    pool = indexer_pool(layout, page_size=page_size, pages=TOKENS // page_size, seed=3)
    return pool, indexer_view(pool)


CASES = [(kind, layout) for kind in ("mla", "mha", "indexer")
         for layout in ("page_first", "page_first_direct")]


def _general(view, object_keys, pages):
    """What the backend describes without the fast path."""
    from kvmove.objects.descriptors import concat, describe_trusted

    return concat([describe_trusted(pool, pages, keys, pool.page_tokens)
                   for pool, keys in zip(view.components, object_keys, strict=True)])


def _backend():
    from kvmove.integrations.sglang.backend import KVMoveStorage

    return object.__new__(KVMoveStorage)  # _describe needs no store


def _object_keys(view, pages):
    return [[f"c{c}-{p}" for p in pages] for c in range(len(view.components))]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), page_size=st.sampled_from([1, 2, 4, 16]), data=st.data())
def test_fast_descriptors_are_the_general_ones(case, page_size, data):
    kind, layout = case
    pool, view = _views(kind, layout, page_size)
    spans = view.spans
    assert spans is not None
    num_pages = view.components[0].num_slots
    pages = data.draw(st.lists(st.integers(0, num_pages - 1), min_size=1, max_size=num_pages,
                               unique=True))
    object_keys = _object_keys(view, pages)
    host_indices = (torch.tensor(pages, dtype=data.draw(st.sampled_from([torch.int32,
                                                                          torch.int64])))
                    [:, None] * page_size + torch.arange(page_size)).reshape(-1)
    want = _general(view, object_keys, pages)
    for got in (_backend()._describe(view, object_keys, host_indices),  # few: Python ints
                spans.describe(object_keys, np.asarray(pages, dtype=np.int64))):  # numpy
        assert got.keys == want.keys
        assert got.ptrs == want.ptrs
        assert got.sizes == want.sizes
        assert got.object_sizes() == want.object_sizes()
        assert got.num_spans == want.num_spans == len(want.keys)
        assert got.total_bytes == want.total_bytes
        assert set(got.regions) == set(want.regions)
        assert got.vouched
    if kind == "indexer":
        return
    # the spans are SGLang's own objects: its pointers, its sizes, k then v
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if kind == "mha":  # SGLang interleaves k and v per page; kvmove is component-major
        ptrs = ptrs[0::2] + ptrs[1::2]
        sizes = sizes[0::2] + sizes[1::2]
    assert [p[0] for p in want.ptrs] == ptrs
    assert [s[0] for s in want.sizes] == sizes


@pytest.mark.parametrize("kind,layout", CASES)
def test_many_pages_take_the_vectorised_check(kind, layout):
    """More than SMALL_ROWS slots: the general (numpy) page check, the same descriptors."""
    from kvmove.checks import SMALL_ROWS

    _, view = _views(kind, layout, 1)
    num_pages = view.components[0].num_slots
    pages = (np.arange(SMALL_ROWS + 8) * 7) % num_pages  # repeats: only shapes matter here
    host_indices = torch.as_tensor(pages, dtype=torch.int64)
    assert view.spans.few_pages(host_indices, len(pages)) is None
    object_keys = [[f"c{c}-{i}" for i in range(len(pages))]
                   for c in range(len(view.components))]
    got = _backend()._describe(view, object_keys, host_indices)
    want = _general(view, object_keys, pages.tolist())
    assert (got.keys, got.ptrs, got.sizes) == (want.keys, want.ptrs, want.sizes)
    assert got.object_sizes() == want.object_sizes()


def test_layer_first_has_no_fast_path():
    _, view = _views("mla", "layer_first", 4)
    assert view.spans is None


BAD = [
    ("not whole pages", torch.arange(3), 1, ValueError),
    ("does not start a page", torch.arange(1, 5), 1, ValueError),
    ("outside the pool", torch.arange(TOKENS * 4, TOKENS * 4 + 4), 1, IndexError),
    ("negative", torch.arange(-4, 0), 1, IndexError),
    ("floats", torch.arange(4, dtype=torch.float32), 1, TypeError),
    ("bools", torch.ones(4, dtype=torch.bool), 1, TypeError),
    ("2-d", torch.arange(4).reshape(1, 4), 1, ValueError),
    ("too many keys", torch.arange(4), 2, ValueError),
]


@pytest.mark.parametrize("what,host_indices,n,error", BAD, ids=[b[0] for b in BAD])
def test_bad_host_indices_raise_the_general_errors(what, host_indices, n, error):
    """page_size 4: the fast check declines, and the general check names what is wrong."""
    _, view = _views("mla", "page_first", 4)
    assert view.spans.few_pages(host_indices, n) is None
    with pytest.raises(error):
        _backend()._describe(view, _object_keys(view, list(range(n))), host_indices)


def test_a_zero_dim_tensor_is_declined():
    _, view = _views("mla", "page_first", 1)
    assert view.spans.few_pages(torch.tensor(3), 1) is None
    assert view.spans.few_pages(torch.tensor([3]), 1) == [3]
