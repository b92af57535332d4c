"""The span plan of a direct send, checked in one process by carrying it out with
``memmove`` between a staging and a guarded host pool: every layout, odd row sizes, hybrid
buffers, partial pages, one layer or all, any slot and page pattern — exactly the bytes the
reference writes, nothing else; spans merged where both sides are contiguous; calls inside
the transport's limits."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmove.direct import spans
from kvmove.direct.handle import BufferPlace
from kvmove.direct.spans import plan_spans
from tests.support.caches import ROW_BYTES
from tests.support.direct_pools import LAYOUTS, apply_send, make_pool


def staging_for(layout: str, buffers: dict, slots: int, page_tokens: int, seed: int):
    """A staging like the sender's for a pool of ``layout``: page-first for page_first,
    else layer-first; its places, and its rows as ``[L, slots * page_tokens, row]``."""
    g = torch.Generator().manual_seed(seed)
    places, rows, keep = [], {}, []
    staging_layout = "page_first" if layout == "page_first" else "layer_first"
    for name, (layers, row) in buffers.items():
        if staging_layout == "page_first":
            t = torch.randint(0, 256, (slots, page_tokens, layers, row), dtype=torch.uint8,
                              generator=g)
            rows[name] = t.permute(2, 0, 1, 3).reshape(layers, slots * page_tokens, row)
        else:
            t = torch.randint(0, 256, (layers, slots, page_tokens * row), dtype=torch.uint8,
                              generator=g)
            rows[name] = t.view(layers, slots * page_tokens, row)
        keep.append(t)
        places.append(BufferPlace.of_view(name, t, layout=staging_layout, layers=layers,
                                          row_bytes=row, page_tokens=page_tokens,
                                          num_pages=slots))
    return places, rows, keep


def dst_places(pool) -> list[BufferPlace]:
    return [BufferPlace.of_view(n, pool.tensor(n), layout=pool.layout,
                                layers=pool.num_layers(n), row_bytes=pool.row_bytes(n),
                                page_tokens=pool.page_tokens, num_pages=pool.num_slots)
            for n in pool.buffer_names]


def carry_out(plan) -> None:
    for k in range(plan.num_calls):
        for s, d, n in zip(*plan.call(k), strict=True):
            ctypes.memmove(d, s, n)


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    p = draw(st.integers(1, 5))
    names = draw(st.lists(st.sampled_from(["kv", "idx", "v"]), min_size=1, max_size=3,
                          unique=True))
    buffers = {n: [draw(st.integers(1, 4)), draw(st.sampled_from(ROW_BYTES))] for n in names}
    pages = draw(st.integers(1, 8))
    slots = draw(st.integers(1, 8))
    n = draw(st.integers(1, min(pages, slots)))
    dst = draw(st.permutations(range(pages)))[:n]
    slot_of = draw(st.permutations(range(slots)))[:n]
    valid = [draw(st.integers(1, p)) for _ in range(n)]
    layer = draw(st.none() | st.integers(0, max(v[0] for v in buffers.values()) - 1))
    extra = draw(st.integers(0, 2))
    return layout, p, buffers, pages, slots, dst, slot_of, valid, layer, extra


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_plan_writes_exactly_the_pages_and_nothing_else(case):
    layout, p, buffers, pages, slots, dst, slot_of, valid, layer, extra = case
    spec = {"layout": layout, "page_tokens": p, "pages": pages, "buffers": buffers,
            "extra_tokens": 0 if layout == "page_first_direct" else extra}
    pool, wholes, views = make_pool(spec, seed=1)
    expected_wholes = {n: w.clone() for n, w in wholes.items()}
    expected_views = {n: expected_wholes[n][4096:4096 + v.numel()].view(v.shape)
                      for n, v in views.items()}
    src, rows, _keep = staging_for(layout, buffers, slots, p, seed=2)
    token_pages = [[s * p + t if t < v else -1 for t in range(p)]
                   for s, v in zip(slot_of, valid, strict=True)]
    plan = plan_spans(src, dst_places(pool), np.array(slot_of, dtype=np.int64),
                      np.array(dst, dtype=np.int64), np.array(valid, dtype=np.int64), layer, p)
    carry_out(plan)
    apply_send(expected_views, rows, layout, p, token_pages, dst, layer)
    for name in buffers:
        assert torch.equal(wholes[name], expected_wholes[name]), name
    assert plan.landed(plan.num_calls).all() and not plan.landed(0).any()
    chosen = {n: (range(L) if layer is None else [layer] if layer < L else [])
              for n, (L, _) in buffers.items()}
    want = [v * sum(buffers[n][1] * len(chosen[n]) for n in buffers) for v in valid]
    assert plan.page_bytes.tolist() == want


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consecutive_pages_merge_where_both_sides_are_contiguous(layout):
    # 61 layers x 16 tokens x 656 B (DSA): 8 consecutive destination pages from 8
    # consecutive slots.
    buffers = {"kv": [61, 656]}
    pool, _, _ = make_pool({"layout": layout, "page_tokens": 16, "pages": 32,
                            "buffers": buffers}, seed=0)
    src, _, _keep = staging_for(layout, buffers, 8, 16, seed=0)
    args = (src, dst_places(pool), np.arange(8), np.arange(10, 18), np.full(8, 16))
    whole = plan_spans(*args, None, 16)
    one_layer = plan_spans(*args, 5, 16)
    expected = {"layer_first": (61, 1), "page_first": (1, 8 * 16),
                "page_first_direct": (61 * 8, 8)}[layout]
    assert (whole.num_spans, one_layer.num_spans) == expected
    # A partial page ends a run: the next page starts a new span.
    valid = np.full(8, 16)
    valid[3] = 5
    cut = plan_spans(*args[:4], valid, None, 16)
    assert cut.num_spans == {"layer_first": 2 * 61, "page_first": 2,
                             "page_first_direct": 61 * 8}[layout]


def test_calls_stay_inside_the_transport_limits(monkeypatch):
    monkeypatch.setattr(spans, "MAX_SPAN_BYTES", 3000)
    monkeypatch.setattr(spans, "MAX_BYTES_PER_CALL", 10_000)
    monkeypatch.setattr(spans, "MAX_SPANS_PER_CALL", 7)
    buffers = {"kv": [5, 656], "idx": [3, 132]}
    pool, _, views = make_pool({"layout": "layer_first", "page_tokens": 4, "pages": 40,
                               "buffers": buffers}, seed=3)
    src, rows, _keep = staging_for("layer_first", buffers, 40, 4, seed=4)
    n = 40
    plan = plan_spans(src, dst_places(pool), np.arange(n), np.arange(n), np.full(n, 4), None, 4)
    assert plan.num_calls > 1
    for k in range(plan.num_calls):
        _, _, lengths = plan.call(k)
        assert len(lengths) <= 7 and max(lengths) <= 3000
        assert sum(lengths) - lengths[-1] < 10_000
    # A page is in place once every call that writes it has returned 0, and only then.
    firsts = {k: plan.landed(k) for k in range(plan.num_calls + 1)}
    assert all((firsts[k] <= firsts[k + 1]).all() for k in range(plan.num_calls))
    carry_out(plan)
    expected = {name: v.clone() for name, v in views.items()}
    apply_send(expected, rows, "layer_first", 4, [[s * 4 + t for t in range(4)]
                                                  for s in range(n)], range(n))
    assert all(torch.equal(views[name], expected[name]) for name in buffers)


def test_a_span_outside_the_destination_region_is_refused():
    buffers = {"kv": [2, 64]}
    pool, _, _ = make_pool({"layout": "layer_first", "page_tokens": 2, "pages": 4,
                            "buffers": buffers}, seed=0)
    src, _, _keep = staging_for("layer_first", buffers, 4, 2, seed=0)
    [d] = dst_places(pool)
    small = BufferPlace(**{**d.__dict__, "nbytes": d.nbytes - 64})
    with pytest.raises(ValueError, match="outside buffer 'kv'"):
        plan_spans(src, [small], np.arange(4), np.arange(4), np.full(4, 2), None, 2)
