"""``kvmove.HostPool``: pages of a host pool the engine allocated (SGLang's MLA pools
``[L, size, 1, dim]`` / ``[size, L, 1, dim]`` / ``[pages, L, page, 1, dim]`` and the halves
of its MHA ``[2, ...]`` pools), described in place: the spans are where the engine's own
per-page arithmetic puts them, the objects are its objects, and a round trip through a real
store moves exactly the pages named."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.objects.descriptors import concat


def mla_pool(layout: str, layers: int, size: int, page: int, dim: int = 16, *, seed: int = 0,
             dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = {"layer_first": (layers, size, 1, dim), "page_first": (size, layers, 1, dim),
             "page_first_direct": (size // page, layers, page, 1, dim)}[layout]
    return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(dtype)


def page_bytes(t: torch.Tensor, layout: str, page: int, p: int) -> bytes:
    """The engine's object of page ``p`` (SGLang's get_data_page, flattened)."""
    if layout == "layer_first":
        data = t[:, p * page:(p + 1) * page]
    elif layout == "page_first":
        data = t[p * page:(p + 1) * page]
    else:
        data = t[p]
    return data.contiguous().view(torch.uint8).numpy().tobytes()


def object_bytes(desc, i):
    return b"".join(ctypes.string_at(a, n) for a, n in zip(desc.ptrs[i], desc.sizes[i],
                                                             strict=True))


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(["layer_first", "page_first", "page_first_direct"]),
       layers=st.integers(1, 6), page=st.sampled_from([1, 2, 4]), data=st.data())
def test_objects_are_the_engine_pages(layout, layers, page, data):
    size = 8 * page
    t = mla_pool(layout, layers, size, page, seed=layers)
    pool = kvmove.HostPool({"kv": t}, page_tokens=page, layout=layout)
    assert pool.num_slots == 8
    pages = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=6, unique=True))
    tokens = torch.tensor([p * page + i for p in pages for i in range(page)])
    assert pool.pages_of(tokens).tolist() == pages
    desc = kvmove.describe(pool, pool.pages_of(tokens), [f"k{p}" for p in pages])
    for i, p in enumerate(pages):
        assert object_bytes(desc, i) == page_bytes(t, layout, page, p)
        if layout != "layer_first" or layers == 1 or page == 8:
            assert len(desc.ptrs[i]) == 1  # one contiguous span
    if layout == "layer_first":  # SGLang's own pointer arithmetic, span for span
        row = 16 * 2
        want = [[t.data_ptr() + p * page * row + layer * size * row for layer in range(layers)]
                for p in pages]
        assert desc.ptrs == want and desc.sizes[0] == [page * row] * layers


@pytest.mark.parametrize("layout, pool", [
    ("layer_first", lambda: mla_pool("layer_first", 4, 64, 4)[:, :16]),  # first tokens
    ("page_first_direct", lambda: mla_pool("page_first_direct", 6, 16, 4)[:, :3]),  # layers
])
def test_strided_pools_register_every_byte_their_spans_name(layout, pool):
    t = pool()
    assert not t.is_contiguous()
    hp = kvmove.HostPool({"kv": t}, page_tokens=4, layout=layout)
    desc = kvmove.describe(hp, list(range(hp.num_slots)), [f"k{i}" for i in range(hp.num_slots)])
    assert list(desc.regions) == hp.regions()
    for i in range(hp.num_slots):
        assert object_bytes(desc, i) == page_bytes(t, layout, 4, i)
        for ptr, size in zip(desc.ptrs[i], desc.sizes[i], strict=True):
            assert any(a <= ptr and ptr + size <= a + n for a, n in hp.regions()), (i, ptr)
    (start, nbytes), = hp.regions()  # and no further than the last byte of the view
    last = t[(-1,) * t.dim()]
    assert start + nbytes == last.data_ptr() + t.element_size()


def test_mha_halves_as_separate_objects_in_one_batch():
    layers, size, page, heads, dim = 3, 16, 4, 2, 8
    g = torch.Generator().manual_seed(1)
    kv = torch.randint(0, 255, (2, size, layers, heads, dim), generator=g, dtype=torch.uint8)
    k = kvmove.HostPool({"k": kv[0]}, page_tokens=page, layout="page_first")
    v = kvmove.HostPool({"v": kv[1]}, page_tokens=page, layout="page_first")
    pages = k.pages_of(torch.arange(4, 12))
    desc = concat([kvmove.describe(k, pages, ["a_k", "b_k"]),
                   kvmove.describe(v, pages, ["a_v", "b_v"])])
    assert desc.keys == ["a_k", "b_k", "a_v", "b_v"]
    assert desc.object_sizes() == [page * layers * heads * dim] * 4
    assert object_bytes(desc, 1) == kv[0, 8:12].contiguous().numpy().tobytes()
    assert object_bytes(desc, 2) == kv[1, 4:8].contiguous().numpy().tobytes()
    assert set(desc.regions) == {(kv[0].data_ptr(), kv[0].nbytes), (kv[1].data_ptr(),
                                                                     kv[1].nbytes)}
    with pytest.raises(ValueError, match="repeat"):
        concat([kvmove.describe(k, pages, ["a", "b"]), kvmove.describe(v, pages, ["b", "c"])])


@pytest.mark.store
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_store_round_trip_moves_exactly_the_pages_named(layout, store, keyspace):
    layers, size, page = 4, 32, 4
    src_t = mla_pool(layout, layers, size, page, seed=2)
    dst_t = mla_pool(layout, layers, size, page, seed=3)
    before = dst_t.clone()
    src = kvmove.HostPool({"kv": src_t}, page_tokens=page, layout=layout)
    dst = kvmove.HostPool({"kv": dst_t}, page_tokens=page, layout=layout)
    keys = keyspace(3)
    assert store.put(kvmove.describe(src, [1, 5, 6], keys)) == [kvmove.Status.OK] * 3
    missing = keyspace(1, tag="missing")
    got = store.get(kvmove.describe(dst, [0, 7, 3, 2], [keys[0], *missing, keys[1], keys[2]]))
    assert got == [kvmove.Status.OK, kvmove.Status.MISS, kvmove.Status.OK, kvmove.Status.OK]
    for d, s in ((0, 1), (3, 5), (2, 6)):
        assert page_bytes(dst_t, layout, page, d) == page_bytes(src_t, layout, page, s)
    for p in (1, 4, 5, 6, 7):  # not read into: untouched, the missed page included
        assert page_bytes(dst_t, layout, page, p) == page_bytes(before, layout, page, p)


def test_bad_pools_and_indices_raise_clearly():
    t = mla_pool("layer_first", 2, 16, 4)
    with pytest.raises(ValueError, match="layout must be one of"):
        kvmove.HostPool({"kv": t}, page_tokens=4, layout="page_head")
    with pytest.raises(ValueError, match="page_tokens"):
        kvmove.HostPool({"kv": t}, page_tokens=0, layout="layer_first")
    with pytest.raises(ValueError, match="contiguous"):
        kvmove.HostPool({"kv": mla_pool("page_first", 2, 16, 4).transpose(0, 1)},
                        page_tokens=4, layout="page_first")
    with pytest.raises(ValueError, match="page_tokens=4"):
        kvmove.HostPool({"kv": mla_pool("page_first_direct", 2, 16, 2)}, page_tokens=4,
                        layout="page_first_direct")
    with pytest.raises(ValueError, match="same number of pages"):
        kvmove.HostPool({"a": t, "b": mla_pool("layer_first", 2, 32, 4)}, page_tokens=4,
                        layout="layer_first")
    pool = kvmove.HostPool({"kv": t}, page_tokens=4, layout="layer_first")
    with pytest.raises(ValueError, match="whole number of pages"):
        pool.pages_of(torch.arange(6))
    with pytest.raises(ValueError, match="does not start a page"):
        pool.pages_of(torch.arange(2, 6))
    with pytest.raises(IndexError, match="outside the pool's 4 pages"):
        pool.pages_of(torch.arange(16, 20))
    with pytest.raises(IndexError, match="slots"):
        kvmove.describe(pool, [4], ["k"])
