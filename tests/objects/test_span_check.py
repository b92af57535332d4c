"""The span check (:mod:`kvmove.objects.span_check`): a span passes only when it lies inside
ONE region, and descriptors say whether kvmove vouches for their spans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvmove
from kvmove.objects.descriptors import Descriptors, concat
from kvmove.objects.span_check import check_spans, first_outside


def inside_one(p: int, s: int, regions: list[tuple[int, int]]) -> bool:
    return any(a <= p and p + s <= a + n for a, n in regions)


@st.composite
def regions_and_spans(draw):
    """Disjoint regions (gaps of 0 allowed: touching regions are still two), and spans
    around them: inside, touching an end, one byte past, straddling, in a gap."""
    at, regions = draw(st.integers(1, 1 << 20)), []
    for _ in range(draw(st.integers(0, 5))):
        at += draw(st.integers(0, 64))
        n = draw(st.integers(1, 256))
        regions.append((at, n))
        at += n
    anchors = [a for a, _ in regions] + [a + n for a, n in regions] + [1, at + 1]
    spans = []
    for _ in range(draw(st.integers(1, 20))):
        p = max(1, draw(st.sampled_from(anchors)) + draw(st.integers(-300, 300)))
        spans.append((p, draw(st.integers(1, 300))))
    return draw(st.permutations(regions)), spans


@given(regions_and_spans())
def test_first_outside_is_the_first_span_inside_no_single_region(case):
    regions, spans = case
    ptrs, sizes = [p for p, _ in spans], [s for _, s in spans]
    expected = next((i for i, (p, s) in enumerate(spans) if not inside_one(p, s, regions)),
                    None)
    assert first_outside(ptrs, sizes, regions) == expected


@given(st.integers(0, 8191), st.integers(1, 4096))
def test_a_span_past_or_across_a_region_end_is_outside(offset, size):
    base, n = 1 << 30, 4096
    inside = offset + size <= n or (offset >= n and offset + size <= 2 * n)
    assert (first_outside([base + offset], [size], [(base, n), (base + n, n)]) is None) \
        == inside  # a span across two touching regions is outside both


def test_values_no_address_can_have_are_outside():
    regions = [(4096, 4096)]
    assert first_outside([4096, 1 << 64], [1, 1], regions) == 1
    assert first_outside([4096, (1 << 64) - 1], [1, 2], regions) == 1
    assert first_outside([5000], [1], []) == 0
    assert first_outside([], [], []) is None


def test_check_spans_names_the_key_the_address_and_the_size():
    regions = [(0x10000, 0x1000)]
    check_spans(["a", "b"], [[0x10000], [0x10010, 0x10fff]], [[16], [8, 1]], regions)
    with pytest.raises(ValueError, match=r"key 'b': span 0x10fff \+ 2 bytes"):
        check_spans(["a", "b"], [[0x10000], [0x10010, 0x10fff]], [[16], [8, 2]], regions)


def test_only_descriptors_kvmove_worked_out_are_vouched_for():
    raw = Descriptors(["r0", "r1"], [[0x1000], [0x2000]], [[1], [1]])
    assert not raw.vouched and not raw[0:1].vouched and not raw.select([1]).vouched
    staging = kvmove.StagingBuffer(kvmove.KVCache({"kv": torch.zeros(2, 8, 16,
                                                                     dtype=torch.uint8)}),
                                   num_slots=2, page_tokens=4)
    desc = kvmove.describe(staging, [0, 1], ["a", "b"])
    assert desc.vouched and desc[1:].vouched and desc.select([1]).vouched
    assert concat([desc[:1], desc[1:]]).vouched
    assert not concat([desc, raw]).vouched
    (address, nbytes), = staging.regions()
    assert desc.with_trailer([address, address + nbytes - 4], 4).vouched  # inside its memory
    assert not desc.with_trailer([address, address + nbytes - 3], 4).vouched  # 1 byte past
    assert not desc.with_trailer([address, 0x1000], 4).vouched
    assert not raw.with_trailer([0x1000, 0x2000], 1).vouched
