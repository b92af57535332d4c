"""A failed key of a request whose blocks are several buffers, as vLLM acts on it.

One key of the connector is one vLLM (manager) block, and its object is every buffer of that
block: each layer's region, one region per head where a block of one layer is not dense
(``LHBNC``), the several kernel blocks of a manager block (a kernel block size below the
manager's). A key that fails on the get (removed from the store, or replaced by an object of
another size: present to the lookup, failed on the get) must be reported by
``get_block_ids_with_load_errors`` as EVERY block id it was to fill (two requests with the
same prefix, vLLM's prefix cache off, load one key into two blocks), and as nothing else;
the other blocks hold their stored bytes in every buffer, the failed blocks and the blocks
outside the load are untouched.

What vLLM does with the ids (``Scheduler._update_requests_with_invalid_blocks``,
``vllm/v1/core/sched/scheduler.py``, vLLM 0.32): for each request, its ``num_computed_tokens``
is cut at the first of its blocks in the set (``idx * block_size``) and the rest recomputed.
So the request's usable prefix stops exactly at the failed key's block, which the test
checks from the ids with that rule. With several KV cache groups vLLM refuses block ids
(``_handle_invalid_blocks`` raises): kvmove's plan refuses such models
(``plan_from_vllm``).
"""

from __future__ import annotations

import pytest
import torch

from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata
from kvmove.integrations.vllm.plan import BlockTransfer
from tests.integrations.vllm.caches import vllm_layer_caches
from tests.integrations.vllm.test_connector import (  # noqa: F401  (connector_env: autouse)
    BS,
    LAYERS,
    NUM_BLOCKS,
    block_hashes,
    connector_env,
    finish_async,
    load,
    plan_for,
    worker_side,
)

HEADS = 2
# (layout, kernel blocks per vLLM block)
CACHES = [("LBHNC", 1), ("LHBNC", 1), ("BLHNC", 1), ("LBHNC", 2)]
MODES = [("staged", "layerwise"), ("in_place", "whole"), ("staged", "async"),
         ("in_place", "async")]


def kv_caches(layout: str, kernel: int, seed: int, zero: bool = False) -> list[torch.Tensor]:
    """Per layer ``[NUM_BLOCKS * kernel, HEADS, BS // kernel, C]`` views in ``layout``."""
    out = vllm_layer_caches(layout, LAYERS, NUM_BLOCKS * kernel, HEADS, BS // kernel, 64,
                            seed=seed)
    if zero:
        for c in out:
            c.zero_()
    return out


def buffers_of(kv: list[torch.Tensor], kernel: int, block: int) -> list[bytes]:
    """vLLM block ``block``'s bytes, buffer by buffer: per layer, per head, per kernel block."""
    return [kb[h].contiguous().view(torch.uint8).numpy().tobytes()
            for c in kv for kb in c[block * kernel:(block + 1) * kernel] for h in range(HEADS)]


def vllm_computed_blocks(block_ids: list[int], invalid: set[int]) -> int:
    """The blocks of a request vLLM keeps as computed after a load: up to the first block in
    ``invalid`` (``Scheduler._update_requests_with_invalid_blocks``)."""
    return next((i for i, b in enumerate(block_ids) if b in invalid), len(block_ids))


# Every cache layout with both ways of failing, every path and mode twice (a covering set,
# not the whole product: each case saves and loads through two worker sides).
CASES = [(layout, kernel, how, *MODES[(i + 2 * j) % len(MODES)])
         for i, (layout, kernel) in enumerate(CACHES)
         for j, how in enumerate(("removed", "wrong_size"))]


@pytest.mark.parametrize("layout,kernel,how,path,mode", CASES)
def test_a_failed_key_marks_every_block_it_covers(layout, kernel, how, path, mode):
    plan = plan_for(path, layerwise=mode == "layerwise", load_async=mode == "async")
    keys = [h.hex() for h in block_hashes(f"load-errors-{layout}-{kernel}-{how}-{path}-{mode}",
                                          4)]
    src = kv_caches(layout, kernel, seed=31)
    saved_ids = [1, 2, 3, 4]
    with worker_side(plan, src) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys, saved_ids, 0)]))
        w._reap_saves(wait=True)
        failed = 2  # the request's third block
        key = w.key_prefix + keys[failed]
        w.store.remove([key], force=True)
        if how == "wrong_size":
            assert w.store.raw_client.put(key, bytes(16)) == 0

    # Two requests with the same prefix, into blocks of their own, not in order (as vLLM
    # hands them out).
    c_ids, d_ids = [9, 3, 12, 7], [13, 14, 15, 10]
    dst = kv_caches(layout, kernel, seed=32, zero=True)
    meta = KVMoveConnectorMetadata(loads=[BlockTransfer("c", keys, c_ids),
                                          BlockTransfer("d", keys, d_ids)])
    with worker_side(plan, dst) as w:
        if mode == "async":
            w.start_load(meta)
            passes = finish_async(w)
            assert len(passes) == 1 and passes[0][0] == {"c", "d"}
            errors = passes[0][1]
        else:
            errors = load(w, meta)
        assert w.take_load_errors() == set()
    assert errors == {c_ids[failed], d_ids[failed]}
    assert vllm_computed_blocks(c_ids, errors) == vllm_computed_blocks(d_ids, errors) == failed
    zero = [bytes(len(b)) for b in buffers_of(dst, kernel, 0)]
    for ids in (c_ids, d_ids):
        for i, (s, d) in enumerate(zip(saved_ids, ids, strict=True)):
            want = zero if i == failed else buffers_of(src, kernel, s)
            assert buffers_of(dst, kernel, d) == want, (ids, i)
    loaded = set(c_ids) | set(d_ids)
    for b in range(NUM_BLOCKS):
        if b not in loaded:
            assert buffers_of(dst, kernel, b) == zero
