"""``InPlaceRows``: descriptors of the KV rows in place name, byte for byte, the object a
staging buffer of the same layout holds (both layouts, several buffers, odd row sizes,
padded row pitches, stacked and per-layer tensors, partial pages, padding inside and after
the valid rows), and a get through them lands the rows a scatter would; spans merge where
rows run on in one region and never across regions; arguments are checked as
``describe``'s are. No store: the spans are read and written here, byte by byte."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.objects import in_place
from kvmove.objects.in_place import InPlaceRows, rows_reachable
from tests.support.caches import buffer_specs, build_cache, make_layers, snapshot


def object_bytes(desc: kvmove.Descriptors, i: int) -> bytes:
    """Object ``i`` as the store would assemble it from its spans."""
    return b"".join(ctypes.string_at(p, n) for p, n in zip(desc.ptrs[i], desc.sizes[i],
                                                           strict=True))


def write_object(desc: kvmove.Descriptors, i: int, data: bytes) -> None:
    """What a get does: split ``data`` over object ``i``'s spans, in order."""
    assert len(data) == desc.nbytes(i)
    at = 0
    for p, n in zip(desc.ptrs[i], desc.sizes[i], strict=True):
        ctypes.memmove(p, data[at:at + n], n)
        at += n


def assert_counts(desc: kvmove.Descriptors) -> None:
    """The span and byte counts the descriptors report (set when they were made, where
    known) are those of their lists."""
    assert desc.num_spans == sum(map(len, desc.ptrs))
    assert desc.total_bytes == sum(map(sum, desc.sizes)) == sum(
        desc.nbytes(i) for i in range(len(desc)))


@st.composite
def calls(draw):
    """A cache, a page size, a layout and pages of it: scattered or consecutive slots, some
    ``-1`` (padding, also inside the valid rows), partial pages."""
    specs = draw(buffer_specs(max_buffers=3, max_layers=4))
    page_tokens = draw(st.sampled_from([1, 2, 3, 4]))
    layout = draw(st.sampled_from(["layer_first", "page_first"]))
    n = draw(st.integers(1, 4))
    num_slots = 2 * n * page_tokens + 3
    order = draw(st.sampled_from(["consecutive", "scattered"]))
    if order == "consecutive":
        start = draw(st.integers(0, num_slots - n * page_tokens))
        slots = np.arange(start, start + n * page_tokens)
    else:
        slots = np.array(draw(st.permutations(range(num_slots)))[: n * page_tokens])
    pages = slots.reshape(n, page_tokens).copy()
    holes = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, page_tokens - 1)),
                          max_size=3))
    for i, t in holes:
        pages[i, t] = -1
    valid = draw(st.lists(st.integers(1, page_tokens), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    return specs, page_tokens, layout, num_slots, pages, valid, seed


@given(calls())
@settings(max_examples=60, deadline=None)
def test_objects_in_place_are_the_staged_objects_byte_for_byte(call):
    specs, page_tokens, layout, num_slots, pages, valid, seed = call
    kv = build_cache(specs, num_slots, seed=seed)
    n = len(pages)
    keys = [f"k{i}" for i in range(n)]
    staging = kvmove.StagingBuffer(kv, num_slots=n, page_tokens=page_tokens, layout=layout)
    slots = torch.arange(n)
    kvmove.gather(kv, staging, torch.from_numpy(pages), slots)  # padding rows stay zero
    staged = kvmove.describe(staging, slots, keys, valid_tokens=valid)
    rows = InPlaceRows(kv, page_tokens, layout)
    put = rows.describe(torch.from_numpy(pages), keys, valid_tokens=valid)
    assert_counts(put)
    regions = rows.regions()
    for i in range(n):
        assert put.nbytes(i) == staged.nbytes(i)
        assert object_bytes(put, i) == object_bytes(staged, i), (layout, i)
        for p, size in zip(put.ptrs[i], put.sizes[i], strict=True):  # inside one region
            assert any(a <= p and p + size <= a + m for a, m in regions), (p, size)
        # Merged as far as it goes: no span of a key ends where its next one starts in
        # the same region.
        for (p, s), q in zip(zip(put.ptrs[i], put.sizes[i], strict=True), put.ptrs[i][1:],
                             strict=False):
            if p + s == q:
                assert not any(a <= p < a + m and a <= q < a + m for a, m in regions)
    rows.close()


@given(calls())
@settings(max_examples=40, deadline=None)
def test_a_get_in_place_lands_what_a_scatter_lands(call):
    specs, page_tokens, layout, num_slots, pages, valid, seed = call
    source = build_cache(specs, num_slots, seed=seed)
    scattered = build_cache(specs, num_slots, seed=seed + 1)
    in_place_kv = build_cache(specs, num_slots, seed=seed + 1)
    n = len(pages)
    keys = [f"k{i}" for i in range(n)]
    staging = kvmove.StagingBuffer(source, num_slots=n, page_tokens=page_tokens, layout=layout)
    slots = torch.arange(n)
    src = torch.arange(n * page_tokens).reshape(n, page_tokens)
    kvmove.gather(source, staging, src, slots)
    staged = kvmove.describe(staging, slots, keys, valid_tokens=valid)
    # Only the valid rows of a page are in its object: past them a scatter writes nothing.
    dst = torch.from_numpy(np.where(np.arange(page_tokens) < np.array(valid)[:, None],
                                    pages, -1))
    kvmove.scatter(staging, slots, scattered, dst)
    rows = InPlaceRows(in_place_kv, page_tokens, layout)
    get = rows.describe(torch.from_numpy(pages), keys, valid_tokens=valid, get=True)
    for i in range(n):
        write_object(get, i, object_bytes(staged, i))
    want, got = snapshot(scattered), snapshot(in_place_kv)
    for name in want:
        for layer, (a, b) in enumerate(zip(want[name], got[name], strict=True)):
            assert torch.equal(a, b), (name, layer)
    rows.close()


def test_rows_that_run_on_merge_into_one_span_per_layer_or_per_page():
    stacked = kvmove.KVCache({"kv": make_layers(3, 64, 656, torch.uint8, stacked=True)})
    rows = InPlaceRows(stacked, 4)
    desc = rows.describe(torch.tensor([[8, 9, 10, 11], [20, 22, 24, 26]]), ["a", "b"])
    assert desc.sizes[0] == [4 * 656] * 3  # one span per layer, as staging's
    assert desc.sizes[1] == [656] * 12  # scattered tokens: one span per row
    # A token-major cache (layers side by side in each slot), page_first: one span per page.
    token_major = torch.zeros(64, 3, 132, dtype=torch.uint8)
    kv = kvmove.KVCache({"kv": [token_major[:, layer] for layer in range(3)]})
    rows = InPlaceRows(kv, 4, layout="page_first")
    desc = rows.describe(torch.tensor([[4, 5, 6, 7]]), ["a"])
    assert desc.ptrs[0] == [token_major[4].data_ptr()] and desc.sizes[0] == [4 * 3 * 132]


def test_spans_never_merge_across_two_allocations_that_touch():
    memory = bytearray(2 * 16 * 64)
    view = memoryview(memory)
    first = torch.frombuffer(view[: 16 * 64], dtype=torch.uint8).view(16, 64)
    second = torch.frombuffer(view[16 * 64:], dtype=torch.uint8).view(16, 64)
    assert first[15].data_ptr() + 64 == second[0].data_ptr()  # layer 0 runs into layer 1
    kv = kvmove.KVCache({"kv": [first, second]})
    rows = InPlaceRows(kv, 1)
    assert len(rows.kv_regions) == 2
    desc = rows.describe(torch.tensor([[15]]), ["a"])
    assert desc.sizes[0] == [64, 64]  # not one span of 128: two registered regions


def test_padding_reads_zeros_and_lands_in_the_discard_row():
    kv = kvmove.KVCache({"kv": make_layers(2, 16, 132, torch.uint8, seed=3)})
    rows = InPlaceRows(kv, 4)
    pages = torch.tensor([[0, -1, 2, 3]])
    put = rows.describe(pages, ["a"])
    # Per layer: row 0, the zero row, rows 2-3 (consecutive slots: one span).
    assert put.ptrs[0][1::3] == [rows.zero_row] * 2 and put.sizes[0] == [132, 132, 264] * 2
    assert object_bytes(put, 0)[132:264] == bytes(132)
    get = rows.describe(pages, ["a"], get=True)
    assert get.ptrs[0][1::3] == [rows.discard_row] * 2
    # Keys with an out-of-range row (check=False) read into the discard row only.
    bad = rows.describe_trusted(np.array([[0, 1, 99, 3]]), ["a"], np.array([4]), get=True,
                                bad=np.array([True]))
    assert set(bad.ptrs[0]) == {rows.discard_row}
    assert bad.nbytes(0) == put.nbytes(0)


def test_one_token_pages_use_the_prepared_lists_and_agree_with_the_general_path(monkeypatch):
    kv = kvmove.KVCache({"kv": make_layers(4, 32, 1152, torch.bfloat16, stacked=True),
                         "ix": make_layers(2, 32, 132, torch.uint8, pitch_pad=4)})
    pages = torch.tensor([[7], [3], [31], [0]])
    keys = ["a", "b", "c", "d"]
    prepared = InPlaceRows(kv, 1).describe(pages, keys)
    assert_counts(prepared)
    # The layers of one tensor [slots, layers, row]: a slot's rows run on, one span each.
    merged = torch.arange(32 * 2 * 64, dtype=torch.int32).to(torch.uint8).reshape(32, 2, 64)
    touching = kvmove.KVCache({"kv": [merged[:, 0], merged[:, 1]],
                               "ix": [kv.layer("ix", 0), kv.layer("ix", 1)]})
    one_span = InPlaceRows(touching, 1).describe(pages, keys)
    assert [len(p) for p in one_span.ptrs] == [3] * 4  # "kv" merged, "ix" two layers
    assert_counts(one_span)
    monkeypatch.setattr(in_place, "SLOT_TABLE_ROWS", 0)
    general = InPlaceRows(kv, 1)
    assert general._slot_ptrs is None
    desc = general.describe(pages, keys)
    assert_counts(desc)
    assert desc.ptrs == prepared.ptrs and desc.sizes == prepared.sizes
    assert InPlaceRows(touching, 1).describe(pages, keys).ptrs == one_span.ptrs


@pytest.mark.parametrize(
    ("pages", "keys", "kwargs", "error", "match"),
    [
        ([[0, 1, 2, 99]], ["a"], {}, IndexError, "token_pages"),
        ([[0, 1, 2, -2]], ["a"], {}, IndexError, "token_pages"),
        ([[0, 1, 2]], ["a"], {}, ValueError, "shape"),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], ["a"], {}, ValueError, "shape"),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], ["a", "a"], {}, ValueError, "repeats"),
        ([[0, 1, 2, 3]], [""], {}, ValueError, "empty"),
        ([[0, 1, 2, 3]], ["a"], {"valid_tokens": 5}, ValueError, "valid_tokens"),
        ([[0, 1, 2, 3], [3, 4, 5, 6]], ["a", "b"], {"get": True}, ValueError, "more than once"),
        ("not pages", ["a"], {}, TypeError, "token_pages"),
    ],
)
def test_bad_arguments_raise_naming_them(pages, keys, kwargs, error, match):
    kv = kvmove.KVCache({"kv": make_layers(2, 16, 656, torch.uint8)})
    rows = InPlaceRows(kv, 4)
    if isinstance(pages, list):
        pages = torch.tensor(pages)
    with pytest.raises(error, match=match):
        rows.describe(pages, keys, **kwargs)


def test_geometry_arguments_are_checked():
    kv = kvmove.KVCache({"kv": make_layers(2, 16, 656, torch.uint8)})
    with pytest.raises(ValueError, match="page_tokens"):
        InPlaceRows(kv, 0)
    with pytest.raises(ValueError, match="layout"):
        InPlaceRows(kv, 4, layout="page_first_direct")
    with pytest.raises(TypeError, match="KVCache"):
        InPlaceRows({"kv": []}, 4)


def test_only_host_memory_or_a_transport_that_reads_device_memory_is_reachable():
    assert rows_reachable(torch.device("cpu"), "tcp") is None
    assert rows_reachable(torch.device("cuda", 0), "rdma") is None
    why = rows_reachable(torch.device("cuda", 0), "tcp")
    assert "cuda:0" in why and "tcp" in why
