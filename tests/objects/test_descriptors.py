"""describe(): spans in canonical object order, merged where they touch, validated inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
import kvmove.objects.descriptors as descriptors
from kvmove.objects.descriptors import Descriptors
from tests.support.staging_data import GEOMETRIES, canonical, make_staging, span_bytes

ROW_BYTES = (4, 132, 576, 656, 1152, 4100)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("valid_tokens", [None, 3, [8, 1, 5]])
def test_spans_are_the_canonical_object(geometry, valid_tokens):
    staging = make_staging(GEOMETRIES[geometry], num_slots=6, page_tokens=8, seed=1)
    slots = [4, 0, 2]
    desc = kvmove.describe(staging, torch.tensor(slots), ["a", "b", "c"],
                           valid_tokens=valid_tokens)
    vts = [8] * 3 if valid_tokens is None else (
        [valid_tokens] * 3 if isinstance(valid_tokens, int) else valid_tokens)
    layers = sum(staging.num_layers(n) for n in staging.buffer_names)
    assert desc.keys == ["a", "b", "c"] and len(desc) == 3
    for i, (slot, vt) in enumerate(zip(slots, vts, strict=True)):
        expected = canonical(staging, slot, vt)
        assert span_bytes(desc, i) == expected
        assert desc.nbytes(i) == len(expected) == sum(desc.sizes[i])
        assert len(desc.ptrs[i]) == layers  # 6 slots: no two layers touch, nothing merged
    sizes = [len(canonical(staging, s, v)) for s, v in zip(slots, vts, strict=True)]
    assert desc.total_bytes == sum(sizes)
    assert desc.num_spans == sum(map(len, desc.ptrs))


# Python ints for a few spans, numpy above; one slot: its layers touch, spans merge
@pytest.mark.parametrize("keys", [1, 3, 40, 300])
@pytest.mark.parametrize("valid_tokens", [None, 5])
def test_span_and_byte_counts_are_those_of_the_lists(keys, valid_tokens):
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=keys, page_tokens=8, seed=2)
    desc = kvmove.describe(staging, torch.arange(keys).flip(0), [f"k{i}" for i in range(keys)],
                           valid_tokens=valid_tokens)
    assert desc.num_spans == sum(map(len, desc.ptrs))
    assert desc.total_bytes == sum(map(sum, desc.sizes))
    if keys == 1 and valid_tokens is None:  # whole pages of one slot: merged
        assert desc.num_spans < sum(staging.num_layers(n) for n in staging.buffer_names)


def test_span_addresses_follow_buffer_then_layer_order():
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=3, page_tokens=4)
    desc = kvmove.describe(staging, [2], ["k"], valid_tokens=3)
    expected = [
        (staging.tensor(n)[layer, 2].data_ptr(), 3 * staging.row_bytes(n))
        for n in staging.buffer_names for layer in range(staging.num_layers(n))
    ]
    assert list(zip(desc.ptrs[0], desc.sizes[0], strict=True)) == expected
    assert all(type(p) is int for p in desc.ptrs[0] + desc.sizes[0])


def test_one_slot_full_pages_merge_into_one_span_per_buffer():
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=1, page_tokens=4, seed=2)
    full = kvmove.describe(staging, [0], ["k"])
    assert len(full.ptrs[0]) == 2  # layers touch inside each buffer, never across buffers
    assert full.sizes[0] == [4 * 4 * 656, 2 * 4 * 132]
    assert span_bytes(full, 0) == canonical(staging, 0, 4)
    partial = kvmove.describe(staging, [0], ["k"], valid_tokens=3)  # gaps between layers
    assert len(partial.ptrs[0]) == 6
    assert span_bytes(partial, 0) == canonical(staging, 0, 3)


def test_mixed_page_lengths_merge_per_key():
    staging = make_staging(GEOMETRIES["mha"], num_slots=1, page_tokens=4, seed=3)
    desc = kvmove.describe(staging, [0, 0, 0], ["full", "part", "full2"],
                           valid_tokens=[4, 2, 4])
    assert [len(p) for p in desc.ptrs] == [2, 6, 2]
    for i, vt in enumerate([4, 2, 4]):
        assert span_bytes(desc, i) == canonical(staging, 0, vt)


def test_empty_keys_give_empty_descriptors():
    staging = make_staging(GEOMETRIES["mla"], num_slots=2, page_tokens=4)
    for slots in ([], torch.zeros(0, dtype=torch.int64), np.zeros(0, dtype=np.int32)):
        desc = kvmove.describe(staging, slots, [])
        assert len(desc) == 0 and desc.keys == [] and desc.ptrs == [] and desc.sizes == []
        assert desc.total_bytes == 0


def test_slicing_and_select_keep_spans():
    staging = make_staging(GEOMETRIES["mha"], num_slots=4, page_tokens=2, seed=4)
    desc = kvmove.describe(staging, [3, 1, 0, 2], list("wxyz"), valid_tokens=[1, 2, 1, 2])
    part = desc[1:3]
    assert part.keys == ["x", "y"] and part.ptrs == desc.ptrs[1:3]
    assert [part.nbytes(0), part.nbytes(1)] == [desc.nbytes(1), desc.nbytes(2)]
    picked = desc.select([3, 0])
    assert picked.keys == ["z", "w"] and span_bytes(picked, 0) == canonical(staging, 2, 2)
    assert picked.object_sizes() == [desc.nbytes(3), desc.nbytes(0)]
    # span and byte counts (worked out once per descriptors) are each part's own
    assert desc.num_spans == sum(map(len, desc.ptrs)) and desc.total_bytes == sum(
        map(sum, desc.sizes))
    for d in (part, picked, desc[3:], desc[:0], desc.with_trailer([1, 2, 3, 4], 8)):
        assert d.num_spans == sum(map(len, d.ptrs)), d
        assert d.total_bytes == sum(map(sum, d.sizes)), d
    assert desc[0:4] is desc and desc[:] is desc and desc[:9] is desc  # all of it


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.tuples(st.integers(1, 3), st.sampled_from(ROW_BYTES)), min_size=1,
                  max_size=3),
    page_tokens=st.integers(1, 64),
    num_slots=st.integers(1, 5),
    data=st.data(),
)
def test_describe_matches_canonical_bytes(rows, page_tokens, num_slots, data):
    geometry = {f"b{i}": r for i, r in enumerate(rows)}
    staging = make_staging(geometry, num_slots=num_slots, page_tokens=page_tokens,
                           seed=page_tokens)
    n = data.draw(st.integers(0, num_slots))
    slots = data.draw(st.permutations(range(num_slots)))[:n]
    pattern = data.draw(st.sampled_from(["none", "int", "per_key"]))
    if pattern == "none":
        valid_tokens, vts = None, [page_tokens] * n
    elif pattern == "int":
        v = data.draw(st.integers(1, page_tokens))
        valid_tokens, vts = v, [v] * n
    else:
        vts = data.draw(st.lists(st.integers(1, page_tokens), min_size=n, max_size=n))
        valid_tokens = vts
    keys = [f"key{i}" for i in range(n)]
    desc = kvmove.describe(staging, slots, keys, valid_tokens=valid_tokens)
    assert len(desc) == n
    layers = sum(layers for layers, _ in rows)
    for i in range(n):
        assert span_bytes(desc, i) == canonical(staging, slots[i], vts[i])
        merged = num_slots == 1 and vts[i] == page_tokens
        assert len(desc.ptrs[i]) == (len(rows) if merged else layers)
        assert all(s > 0 for s in desc.sizes[i])


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small():
    return make_staging(GEOMETRIES["mha"], num_slots=4, page_tokens=8)


@pytest.mark.parametrize(
    ("slots", "keys", "kwargs", "exc", "match"),
    [
        ([0, 1], ["a"], {}, ValueError, "slots has 2 entries for 1 keys"),
        ([0], ["a", "b"], {}, ValueError, "slots has 1 entries for 2 keys"),
        ([0, 1], ["a", "a"], {}, ValueError, r"keys\[1\] = 'a' repeats"),
        ([0], [""], {}, ValueError, r"keys\[0\] is an empty string"),
        ([0, 1], ["a", 7], {}, TypeError, r"keys\[1\] must be a str, got int 7"),
        ([0], "a", {}, TypeError, "keys must be a sequence of str"),
        ([0], None, {}, TypeError, "keys must be a sequence of str"),
        ([4], ["a"], {}, IndexError, r"slots\[0\] = 4 is out of range 0..3"),
        ([0, -1], ["a", "b"], {}, IndexError, r"slots\[1\] = -1 is out of range"),
        ([0.5], ["a"], {}, TypeError, "slots must hold int64 integers, got 0.5"),
        ([2**70], ["a"], {}, TypeError, "slots must hold int64 integers, got 1180591620"),
        (torch.empty(1, dtype=torch.int64, device="meta"), ["a"], {}, TypeError, "meta tensor"),
        (None, ["a"], {}, ValueError, "slots must be 1-D"),
        (torch.tensor([0.0]), ["a"], {}, TypeError, "slots must hold integers"),
        (torch.tensor([True]), ["a"], {}, TypeError, "slots must hold integers"),
        ([[0]], ["a"], {}, ValueError, "slots must be 1-D"),
        ([0], ["a"], {"valid_tokens": 0}, ValueError, "valid_tokens = 0 is outside 1..8"),
        ([0], ["a"], {"valid_tokens": 9}, ValueError, "valid_tokens = 9 is outside 1..8"),
        ([0, 1], ["a", "b"], {"valid_tokens": [8, 0]}, ValueError,
         r"valid_tokens\[1\] = 0 is outside 1..8"),
        ([0, 1], ["a", "b"], {"valid_tokens": [8]}, ValueError,
         "valid_tokens has 1 entries for 2 keys"),
        ([0], ["a"], {"valid_tokens": 2.0}, TypeError, "valid_tokens must be an int"),
        ([0], ["a"], {"valid_tokens": True}, TypeError, "valid_tokens must be an int"),
    ],
)
def test_bad_input_raises_naming_argument(small, slots, keys, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvmove.describe(small, slots, keys, **kwargs)


def test_descriptors_from_lists_are_validated():
    d = Descriptors(["a"], [[4096, 8192]], [[16, 32]])
    assert d.nbytes(0) == 48 and d.total_bytes == 48 and d.num_spans == 2
    with pytest.raises(ValueError, match="one entry per key"):
        Descriptors(["a", "b"], [[4096]], [[16]])
    with pytest.raises(ValueError, match="must be equal and non-zero"):
        Descriptors(["a"], [[]], [[]])
    with pytest.raises(ValueError, match="must be equal and non-zero"):
        Descriptors(["a"], [[4096, 8192]], [[16]])
    with pytest.raises(ValueError, match="span sizes must be positive"):
        Descriptors(["a"], [[4096]], [[0]])
    with pytest.raises(ValueError, match="repeats"):
        Descriptors(["a", "a"], [[4096], [8192]], [[1], [1]])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.tuples(st.integers(1, 9), st.sampled_from(ROW_BYTES)), min_size=1,
                  max_size=3),
    page_tokens=st.integers(1, 16),
    layout=st.sampled_from(["layer_first", "page_first"]),
    data=st.data(),
)
def test_few_keys_and_many_keys_describe_alike(rows, page_tokens, layout, data):
    """A few spans are worked out in Python ints, many with numpy: the same descriptors,
    either side of the threshold (made to fall on both sides here)."""
    geometry = {f"b{i}": r for i, r in enumerate(rows)}
    staging = make_staging(geometry, num_slots=40, page_tokens=page_tokens, seed=3,
                           layout=layout)
    n = data.draw(st.integers(1, 40))
    slots = data.draw(st.permutations(range(40)))[:n]
    v = data.draw(st.integers(1, page_tokens))
    keys = [f"key{i}" for i in range(n)]
    few = kvmove.describe(staging, slots, keys, valid_tokens=v)
    saved = descriptors.SMALL_SPANS
    descriptors.SMALL_SPANS = 0  # every batch through numpy
    try:
        many = kvmove.describe(staging, slots, keys, valid_tokens=v)
    finally:
        descriptors.SMALL_SPANS = saved
    assert few.ptrs == many.ptrs and few.sizes == many.sizes
    assert few.object_sizes() == many.object_sizes() and few.total_bytes == many.total_bytes
    for i in range(n):
        assert span_bytes(few, i) == canonical(staging, slots[i], v)
