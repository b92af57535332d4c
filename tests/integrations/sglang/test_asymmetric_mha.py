"""SGLang's host pool for MHA models whose K and V head dims differ
(``AsymmetricMHATokenToKVPoolHost``, e.g. MiMo-V2: ``kv_buffer`` is a pair ``(k, v)``):
kvmove's backend stores exactly the objects and keys SGLang's own Mooncake backend stores
for it, reads back what it wrote, and shares pages with SGLang's backend both ways."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.integrations.sglang.conftest import (
    HEADS,
    LAYERS,
    fill,
    kvmove_backend,
    sglang_backend,
    storage_config,
)

PAGE = 4
TOKENS = 64
HEAD_DIM, V_HEAD_DIM = 64, 32  # bf16: k rows of 256 bytes, v rows of 128
LAYOUTS = ["page_first", "page_first_direct"]


def asymmetric_pool(layout: str, seed: int):
    """A CPU host pool as SGLang builds it for head_dim != v_head_dim (its own factory picks
    the class), K and V filled with random bytes."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import (
        AsymmetricMHATokenToKVPoolHost,
        get_mha_host_pool_cls,
    )

    n = TOKENS // 2
    k = [torch.zeros(n, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(n, HEADS, V_HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    buffers = KVBuffers(k=tuple(k), v=tuple(v),
                        k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                        v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                        layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=buffers, page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM,
                         v_head_dim=V_HEAD_DIM, dtype=torch.bfloat16, device=torch.device("cpu"))
    cls = get_mha_host_pool_cls(info)
    assert cls is AsymmetricMHATokenToKVPoolHost
    pool = cls(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
               pin_memory=False, device="cpu", device_capacity_tokens=n, start_layer=0,
               end_layer=LAYERS)
    assert isinstance(pool.kv_buffer, tuple)
    fill(pool.kv_buffer[0], seed)
    fill(pool.kv_buffer[1], seed + 1000)
    return pool


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def page_objects(pool, page: int) -> list[bytes]:
    """Page ``page``'s k and v objects as SGLang's Mooncake backend sends them (the spans of
    the pool's own get_page_buffer_meta)."""
    ptrs, sizes = pool.get_page_buffer_meta(indices([page]))
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["kvmove->kvmove", "sglang->kvmove", "kvmove->sglang"])
def test_round_trip_rows_exact(layout, direction, master, model):
    make = {"sglang": sglang_backend, "kvmove": kvmove_backend}
    writer_kind, reader_kind = direction.split("->")
    writer = make[writer_kind](storage_config(mla=False, page_first=True, model=model))
    reader = make[reader_kind](storage_config(mla=False, page_first=True, model=model))
    try:
        src, dst = asymmetric_pool(layout, 1), asymmetric_pool(layout, 2)
        untouched = {p: page_objects(dst, p) for p in (1, 3, 4, 6)}
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        keys = ["h1", "h3", "h4"]
        assert writer.batch_set_v1(keys, indices([1, 3, 4])) == [True] * 3
        assert reader.batch_exists([*keys, "nothing"]) == 3
        assert reader.batch_get_v1([*keys, "nothing"], indices([0, 5, 2, 7])) == \
            [True, True, True, False]
        for d, s in ((0, 1), (5, 3), (2, 4)):
            assert page_objects(dst, d) == page_objects(src, s)
        for page, objects in untouched.items():  # pages not read into are untouched
            assert page_objects(dst, page) == objects
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_objects_and_keys_are_sglangs(layout, master, model):
    """The objects kvmove stores are, key for key and byte for byte, the ones SGLang's own
    backend would store for the same pages (its keys from its own _batch_preprocess, its
    bytes from the pool's get_page_buffer_meta), read back raw through SGLang's client."""
    config = storage_config(mla=False, page_first=True, model=model, tp_rank=2,
                            extra={"extra_backend_tag": "tag"})
    ours = kvmove_backend(config)
    theirs = sglang_backend(storage_config(mla=False, page_first=True, model=model, tp_rank=2,
                                           extra={"extra_backend_tag": "tag"}))
    try:
        pool = asymmetric_pool(layout, 3)
        ours.register_mem_pool_host(pool)
        theirs.register_mem_pool_host(pool)
        keys, pages = ["a", "b"], [2, 6]
        assert ours.batch_set_v1(keys, indices(pages)) == [True, True]
        names, ptrs, sizes = theirs._batch_preprocess(theirs._tag_keys(keys), indices(pages))
        name = model.replace("/", "-")
        assert names == [f"tag_{name}_{k}_2_{c}" for k in keys for c in "kv"]
        expected = [o for p in pages for o in page_objects(pool, p)]
        assert [len(o) for o in expected] == \
            [PAGE * LAYERS * HEADS * d * 2 for _ in pages for d in (HEAD_DIM, V_HEAD_DIM)]
        assert expected == [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True)]
        assert [theirs.store.get(n) for n in names] == expected
    finally:
        ours.close()
        theirs.close()


def test_a_malformed_pair_is_refused_with_a_value_error(master, model):
    """A (k, v) pair kvmove cannot describe raises ValueError naming the pool at
    registration, never an AttributeError."""
    backend = kvmove_backend(storage_config(mla=False, page_first=True, model=model))
    try:
        pool = asymmetric_pool("page_first", 4)
        k, v = pool.kv_buffer
        pool.kv_buffer = (k, v[: v.shape[0] // 2])  # V holds half the tokens of K
        with pytest.raises(ValueError, match="AsymmetricMHATokenToKVPoolHost"):
            backend.register_mem_pool_host(pool)
        pool.kv_buffer = (k,)
        with pytest.raises(ValueError, match="AsymmetricMHATokenToKVPoolHost"):
            backend.register_mem_pool_host(pool)
    finally:
        backend.close()
