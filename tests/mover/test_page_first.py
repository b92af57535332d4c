"""Page-first staging (``layout="page_first"``): the staging tensor holds a page token by
token, every layer's row side by side; a key's object is one span per buffer, SGLang's
``page_first`` object. Every backend writes the same bytes; ``KVMover`` round trips whole,
partial and hybrid pages; and a reader of one layout never takes the other's objects."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from tests.support.caches import buffer_specs, build_cache, make_layers, snapshot

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def object_bytes(desc: kvmove.Descriptors, i: int) -> bytes:
    return b"".join(ctypes.string_at(p, s) for p, s in zip(desc.ptrs[i], desc.sizes[i],
                                                             strict=True))


def expected_object(kv: kvmove.KVCache, token_rows: list[int], layout: str) -> bytes:
    """The object of a page whose valid tokens sit in KV slots ``token_rows``."""
    out = []
    for name in kv.buffer_names:
        rows = torch.stack([kv.layer(name, layer)[token_rows]
                            for layer in range(kv.num_layers(name))])  # [L, tokens, row]
        if layout == "page_first":
            rows = rows.transpose(0, 1)
        out.append(rows.contiguous().numpy().tobytes())
    return b"".join(out)


def test_page_first_tensor_shape_and_rows():
    kv = kvmove.KVCache({"kv": make_layers(3, 32, 24, torch.uint8, stacked=True, seed=1)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4, layout="page_first")
    assert staging.layout == "page_first"
    assert tuple(staging.tensor("kv").shape) == (4, 4, 3, 24)
    kvmove.gather(kv, staging, torch.tensor([[8, 9, 10, 11]]), torch.tensor([2]),
                  backend="torch")
    t = staging.tensor("kv")
    for tok in range(4):
        for layer in range(3):
            assert torch.equal(t[2, tok, layer], kv.layer("kv", layer)[8 + tok])


def test_layout_is_checked():
    kv = kvmove.KVCache({"kv": make_layers(1, 8, 8, torch.uint8)})
    with pytest.raises(ValueError, match="layout must be one of"):
        kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4, layout="token_first")
    with pytest.raises(ValueError, match="layout must be one of"):
        kvmove.KVMover(kv, None, page_tokens=4, staging_slots=2, layout="page_first_direct")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=buffer_specs(max_buffers=3, max_layers=5), page_tokens=st.integers(1, 4),
       data=st.data())
def test_describe_page_first_is_the_token_major_object(specs, page_tokens, data):
    kv = build_cache(specs, 32, seed=3)
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens,
                                   layout="page_first")
    n = data.draw(st.integers(1, 4))
    slots = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    valid = data.draw(st.lists(st.integers(1, page_tokens), min_size=n, max_size=n))
    starts = data.draw(st.lists(st.integers(0, 32 // page_tokens - 1), min_size=n,
                                max_size=n, unique=True))
    pages = torch.tensor([[s * page_tokens + t for t in range(page_tokens)] for s in starts])
    kvmove.gather(kv, staging, pages, torch.tensor(slots), backend="torch")
    desc = kvmove.describe(staging, slots, [f"k{i}" for i in range(n)], valid_tokens=valid)
    for i in range(n):
        assert len(desc.ptrs[i]) == len(kv.buffer_names)  # one span per buffer
        rows = pages[i, : valid[i]].tolist()
        assert object_bytes(desc, i) == expected_object(kv, rows, "page_first")


@pytest.mark.parametrize("backend", ["triton", "torch", "two_hop"])
def test_every_backend_gives_identical_page_first_bytes(backend):
    kv = kvmove.KVCache({"kv": make_layers(3, 64, 656, torch.uint8, stacked=True, seed=4),
                         "indexer": make_layers(2, 64, 132, torch.uint8, pitch_pad=4,
                                                seed=5)})
    pages = torch.tensor([[4, 5, 6, 7], [12, 1, -1, 30], [40, 41, 42, 43]])
    slots = torch.tensor([3, 0, 1])
    ref = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4, layout="page_first")
    kvmove.gather(kv, ref, pages, slots, backend="torch")
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4, layout="page_first")
    kvmove.gather(kv, staging, pages, slots, backend=backend)
    for name in kv.buffer_names:
        assert torch.equal(staging.tensor(name), ref.tensor(name))
    assert staging.tensor("kv")[1].any()  # the gather wrote something
    # and back: scatter into a zeroed copy of the cache
    back = kvmove.KVCache({n: [torch.zeros_like(kv.layer(n, layer))
                               for layer in range(kv.num_layers(n))] for n in kv.buffer_names})
    kvmove.scatter(staging, slots, back, pages, backend=backend)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            rows = pages[pages >= 0]
            assert torch.equal(back.layer(name, layer)[rows], kv.layer(name, layer)[rows])


GEOMETRIES = {
    "mla": lambda: {"kv": make_layers(4, 64, 656, torch.uint8, stacked=True, seed=1)},
    "mha": lambda: {"k": make_layers(3, 64, 576, torch.bfloat16, seed=2),
                    "v": make_layers(3, 64, 576, torch.bfloat16, seed=3)},
    "hybrid": lambda: {"kv": make_layers(5, 64, 1152, torch.bfloat16, seed=4),
                       "indexer": make_layers(2, 64, 132, torch.uint8, pitch_pad=4, seed=5)},
}


@pytest.mark.store
@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_mover_page_first_round_trip_with_partial_last_page(geometry, checksum, store,
                                                            keyspace):
    kv = kvmove.KVCache(GEOMETRIES[geometry]())
    keys = keyspace(3)
    src = torch.tensor([[0, 5, 9, 2], [10, 11, 12, 13], [40, 41, 42, 43]])
    dst = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33], [50, 51, -1, -1]])
    valid = [4, 4, 2]  # a partial last page, padded with -1 in the prefetch
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=8, layout="page_first",
                        key_prefix="pf", checksum=checksum) as mover:
        assert mover.evict(keys, src, valid_tokens=valid).wait(timeout=30) == \
            [kvmove.Status.OK] * 3
        before = snapshot(kv)
        if not checksum:  # the stored object is the page's page_first object
            probe = kvmove.StagingBuffer(kv, num_slots=1, page_tokens=4, layout="page_first")
            desc = kvmove.describe(probe, [0], mover.keyspace.store_keys(keys[2:]),
                                   valid_tokens=2)
            assert store.get(desc) == [kvmove.Status.OK]
            assert object_bytes(desc, 0) == expected_object(kv, src[2, :2].tolist(),
                                                            "page_first")
        statuses = mover.prefetch(keys, dst, valid_tokens=valid).wait(timeout=30)
        assert statuses == [kvmove.Status.OK] * 3
    after = snapshot(kv)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            got, want = after[name][layer], before[name][layer]
            for i, v in enumerate(valid):
                assert torch.equal(got[dst[i, :v]], want[src[i, :v]])
            assert torch.equal(got[52:54], want[52:54])  # past the partial page: untouched


@pytest.mark.store
def test_page_first_reader_never_gets_a_layer_first_object(store, keyspace):
    # One-token pages: the objects of both layouts have the same size.
    kv = kvmove.KVCache({"kv": make_layers(3, 16, 64, torch.uint8, stacked=True, seed=7)})
    keys = keyspace(2)
    pages = torch.tensor([[1], [2]])
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=4, key_prefix="x",
                        layout="layer_first") as writer, \
            kvmove.KVMover(kv, store, page_tokens=1, staging_slots=4, key_prefix="x",
                           layout="page_first") as reader:
        assert writer.keyspace.namespace != reader.keyspace.namespace
        assert writer.evict(keys, pages).wait(timeout=30) == [kvmove.Status.OK] * 2
        before = snapshot(kv)
        got = reader.prefetch(keys, torch.tensor([[5], [6]])).wait(timeout=30)
        assert got == [kvmove.Status.MISS] * 2
        assert all(torch.equal(a, b) for a, b in zip(snapshot(kv)["kv"], before["kv"],
                                                     strict=True))
