"""kvmove's connector objects and keys equal vLLM's ``RankLocalStoreLayout`` objects and keys
on the same KV tensors, for every KV cache layout vLLM has and MLA; no engine."""

from __future__ import annotations

import ctypes
import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    KeyMetadata,
    RankLocalStoreLayout,
)
from vllm.v1.core.kv_cache_utils import BlockHash

import kvmove
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat, block_hashes
from kvmove.integrations.vllm.layout import block_regions
from tests.integrations.vllm.caches import mla_layer_caches, vllm_layer_caches

LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC"]


def vllm_object(layout: RankLocalStoreLayout, block_id: int) -> bytes:
    addrs, sizes = layout.prepare_value_for_block(block_id)
    return b"".join(ctypes.string_at(a, n) for a, n in zip(addrs, sizes, strict=True))


def kvmove_objects(named, num_blocks: int, block_ids: list[int]) -> list[bytes]:
    """The objects kvmove's connector stores for ``block_ids``: gathered into staging and
    read through the descriptors it puts."""
    views, _ = block_regions(named, num_blocks)
    kv = kvmove.KVCache({"kv": views})
    staging = kvmove.StagingBuffer(kv, num_slots=len(block_ids), page_tokens=1)
    slots = torch.arange(len(block_ids))
    kvmove.gather(kv, staging, torch.tensor(block_ids).unsqueeze(1), slots)
    desc = kvmove.describe(staging, slots, [f"b{i}" for i in range(len(block_ids))])
    out = [b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))
           for _, ptrs, sizes in desc]
    staging.close()
    return out


def vllm_layout_for(caches, num_blocks, block_size, **meta) -> RankLocalStoreLayout:
    md = KeyMetadata(model_name=meta.get("model", "tiny-llama"), tp_rank=meta.get("tp", 0),
                     pcp_rank=0, dcp_rank=0, pp_rank=meta.get("pp", 0),
                     cache_prefix=meta.get("prefix", ""))
    layout = RankLocalStoreLayout(md, block_size, block_size)
    layout.register_kv_caches(caches, num_blocks)
    return layout


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    layers=st.integers(1, 4),
    blocks=st.integers(2, 9),
    heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 4, 16]),
    head_bytes=st.sampled_from([8, 64, 160]),
    picks=st.lists(st.integers(0, 1000), min_size=1, max_size=6, unique=True),
)
def test_objects_equal_vllm_rank_local_layout(layout, layers, blocks, heads, block_size,
                                              head_bytes, picks):
    caches = vllm_layer_caches(layout, layers, blocks, heads, block_size, head_bytes,
                               seed=len(picks))
    block_ids = sorted({p % blocks for p in picks}, reverse=True)  # not contiguous, reversed
    vllm = vllm_layout_for(caches, blocks, block_size)
    named = [(f"model.layers.{i}.self_attn.attn", c) for i, c in enumerate(caches)]
    ours = kvmove_objects(named, blocks, block_ids)
    assert ours == [vllm_object(vllm, b) for b in block_ids]
    layer_bytes = heads * block_size * head_bytes
    assert all(len(o) == layers * layer_bytes for o in ours)


@pytest.mark.parametrize("layers,blocks,block_size,entry_bytes", [(3, 7, 16, 1152),
                                                                  (2, 5, 64, 656)])
def test_mla_objects_equal_vllm(layers, blocks, block_size, entry_bytes):
    caches = mla_layer_caches(layers, blocks, block_size, entry_bytes, seed=3)
    vllm = vllm_layout_for(caches, blocks, block_size)
    named = [(f"l{i}", c) for i, c in enumerate(caches)]
    ids = [4, 0, 2]
    assert kvmove_objects(named, blocks, ids) == [vllm_object(vllm, b) for b in ids]


@settings(max_examples=30, deadline=None)
@given(
    model=st.sampled_from(["tiny-llama", "/models/org/Llama-3-8B/", "Qwen3"]),
    prefix=st.sampled_from(["", "team-a"]),
    tp=st.integers(0, 7),
    pp=st.integers(0, 3),
    n=st.integers(1, 5),
)
def test_keys_equal_vllm(model, prefix, tp, pp, n):
    hashes = [hashlib.sha256(f"{model}{i}".encode()).digest() for i in range(n)]
    md = KeyMetadata(model_name=VLLMKeyFormat.model_basename(model), tp_rank=tp, pcp_rank=0,
                     dcp_rank=0, pp_rank=pp, cache_prefix=prefix)
    layout = RankLocalStoreLayout(md, 16, 16)
    ours = VLLMKeyFormat(VLLMKeyFormat.model_basename(model), cache_prefix=prefix).keys(
        RankNamespace(tp_rank=tp, pp_rank=pp), hashes)
    assert ours == [layout.key_for(0, BlockHash(h)) for h in hashes]


def test_block_hashes_take_the_last_hash_of_each_block():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        chunk_hashes_for_block_size,
    )
    hashes = [bytes([i]) * 8 for i in range(12)]
    for hash_block in (1, 2, 4, 12):
        sub = hashes[: len(hashes) // hash_block * hash_block]
        expected = list(chunk_hashes_for_block_size(sub, 1, hash_block))
        assert block_hashes(sub, 1, hash_block) == [bytes(h) for h in expected]


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_store_round_trip_both_ways(tmp_path, path):
    """Through a real Mooncake store: objects kvmove puts read back into vLLM's block
    addresses byte for byte, and objects put from vLLM's addresses load into kvmove's, on
    both of the mover's paths (through staging, and straight from / into the blocks)."""
    blocks, block_size = 6, 16
    src = vllm_layer_caches("LBHNC", 3, blocks, 2, block_size, 64, seed=11)
    dst = vllm_layer_caches("LBHNC", 3, blocks, 2, block_size, 64, seed=12)
    for c in dst:
        c.zero_()
    named = [(f"l{i}", c) for i, c in enumerate(src)]
    fmt = VLLMKeyFormat("tiny")
    ns = RankNamespace()
    h = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    keys = fmt.keys(ns, h)
    ids = [5, 1, 3, 0]
    with kvmove.MooncakeStore.embedded() as store:
        views, _ = block_regions(named, blocks)
        with kvmove.KVMover(kvmove.KVCache({"kv": views}), store, page_tokens=1,
                            staging_slots=4, raw_keys=True, path=path) as mover:
            assert mover.evict(keys, torch.tensor(ids).unsqueeze(1)).wait() == \
                [kvmove.Status.OK] * 4
        # vLLM reads them into its addresses (its descriptors, kvmove's store calls).
        vdst = vllm_layout_for(dst, blocks, block_size, model="tiny")
        assert [vdst.key_for(0, BlockHash(x)) for x in h] == keys
        store.register([(dst[0].untyped_storage().data_ptr(),
                         dst[0].untyped_storage().nbytes())])
        read_ids = [2, 4, 0, 1]
        spans = [vdst.prepare_value_for_block(b) for b in read_ids]
        got = store.get(kvmove.Descriptors(keys, [s[0] for s in spans], [s[1] for s in spans]))
        assert list(got) == [kvmove.Status.OK] * 4
        vsrc = vllm_layout_for(src, blocks, block_size, model="tiny")
        for a, b in zip(ids, read_ids, strict=True):
            assert vllm_object(vdst, b) == vllm_object(vsrc, a)
        # The reverse: vLLM's descriptors put, kvmove's connector layout loads.
        keys2 = fmt.keys(ns, [hashlib.sha256(b"x" + bytes([i])).digest() for i in range(2)])
        store.register([(src[0].untyped_storage().data_ptr(),
                         src[0].untyped_storage().nbytes())])
        spans = [vsrc.prepare_value_for_block(b) for b in (4, 2)]
        assert list(store.put(kvmove.Descriptors(keys2, [s[0] for s in spans],
                                                 [s[1] for s in spans]))) == \
            [kvmove.Status.OK] * 2
        for c in dst:
            c.zero_()
        views, _ = block_regions([(f"l{i}", c) for i, c in enumerate(dst)], blocks)
        with kvmove.KVMover(kvmove.KVCache({"kv": views}), store, page_tokens=1,
                            staging_slots=2, raw_keys=True, path=path) as mover:
            assert mover.prefetch(keys2, torch.tensor([[3], [5]])).wait() == \
                [kvmove.Status.OK] * 2
        assert vllm_object(vdst, 3) == vllm_object(vsrc, 4)
        assert vllm_object(vdst, 5) == vllm_object(vsrc, 2)
        assert vllm_object(vdst, 0) == bytes(len(vllm_object(vdst, 0)))  # untouched
