"""kvmove's connector without an engine: its scheduler side fed vLLM's scheduler outputs and its
worker side over vLLM-shaped KV caches, against a real Mooncake store. Asserts the metadata
each step carries and the bytes that land in the blocks."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

import kvmove
from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata, KVMoveWorkerMetadata
from kvmove.integrations.vllm.plan import BlockTransfer, ConnectorPlan
from kvmove.integrations.vllm.scheduler import SchedulerSide
from kvmove.integrations.vllm.worker import WorkerSide, block_pages, unique_rounds
from tests.integrations.vllm.caches import vllm_layer_caches
from tests.support.store_state import CHECK, PUT, SlowClient, swap_client
from tests.support.tenants import multi_tenant_store

BS = 32  # tokens per block
LAYERS, NUM_BLOCKS = 2, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(autouse=True)
def connector_env(store, tmp_path, monkeypatch):
    """Both sides reach ``store`` through vLLM's Mooncake JSON; the worker is TP rank 0."""
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "master_server_address": store.address, "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": "64mb"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    import vllm.distributed.parallel_state as parallel_state
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)


def plan_for(path: str = "staged", layerwise: bool = True,
             load_async: bool = False) -> ConnectorPlan:
    return ConnectorPlan(block_size=BS, hash_block_size=BS, keys=VLLMKeyFormat("tiny"),
                         tp_size=1, pp_size=1, replication=1, can_load=True, can_save=True,
                         save_decode=False, layerwise=layerwise, load_async=load_async,
                         staging_bytes=1 << 20, path=path)


def caches(seed: int, zero: bool = False) -> list[torch.Tensor]:
    out = vllm_layer_caches("LBHNC", LAYERS, NUM_BLOCKS, 2, BS, 64, seed=seed)
    if zero:
        for c in out:
            c.zero_()
    return out


def block_bytes(kv: list[torch.Tensor], block_id: int) -> bytes:
    """vLLM block ``block_id``'s object: its bytes layer by layer."""
    return b"".join(c[block_id].contiguous().view(torch.uint8).numpy().tobytes() for c in kv)


@contextlib.contextmanager
def worker_side(plan: ConnectorPlan, kv: list[torch.Tensor]):
    """A worker side over ``kv``; closing it waits for its saves."""
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))
    kv_cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=NAMES)])
    side = WorkerSide(plan, vllm_config, kv_cache_config)
    try:
        side.register_kv_caches(dict(zip(NAMES, kv, strict=True)))
        yield side
    finally:
        side.close()


def load(side: WorkerSide, meta: KVMoveConnectorMetadata) -> set[int]:
    """One step's loads as vLLM drives them; the block ids whose load failed."""
    side.start_load(meta)
    for name in NAMES:
        side.wait_for_layer(name)
    side.save(KVMoveConnectorMetadata())
    return side.take_load_errors()


def block_hashes(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]


def request(req_id: str, hashes: list[bytes], num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_tokens=num_tokens,
                           num_prompt_tokens=num_tokens, block_hashes=hashes)


def output(new=(), cached=None, scheduled=None, finished=()) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(finished), free_encoder_mm_hashes=[])


def new_request(req_id: str, block_ids: list[int], computed: int) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=None, mm_features=[],
                          sampling_params=None, pooling_params=None, block_ids=(block_ids,),
                          num_computed_tokens=computed, lora_request=None)


def cached_request(req_id: str, new_block_ids: list[int] | None, computed: int, *,
                   resumed: bool) -> CachedRequestData:
    """As vLLM's V1 model runner gets it: a resumed request comes with all its blocks."""
    return CachedRequestData(
        req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(), new_token_ids=[],
        all_token_ids={}, new_block_ids=[(new_block_ids,) if new_block_ids else None],
        num_computed_tokens=[computed], num_output_tokens=[0])


def transfers(items: list[BlockTransfer]) -> list[tuple[list[str], list[int]]]:
    return [(t.keys, t.block_ids) for t in items]


def test_a_resumed_request_loads_its_store_hit():
    """A request preempted and resumed (vLLM's V1 model runner: a cached request in
    ``resumed_req_ids``) whose prefix the store holds loads it into its new blocks, once;
    the steps that load save nothing, the next one schedules its blocks from the first and
    the worker puts none of them again (the store has them)."""
    plan = plan_for()
    hashes = block_hashes("resumed", 3)
    keys = [h.hex() for h in hashes]
    sched = SchedulerSide(plan)
    try:
        # An engine computes a 100-token prompt and saves its 3 full blocks.
        first = request("a", hashes, 100)
        assert sched.matched_tokens(first, 0) == 0
        sched.after_alloc(first, [7, 8, 9, 10], 0)
        meta = sched.build_meta(output([new_request("a", [7, 8, 9, 10], 0)],
                                       scheduled={"a": 100}))
        assert meta.loads == [] and transfers(meta.saves) == [(keys, [7, 8, 9])]
        src = caches(seed=1)
        with worker_side(plan, src) as w:
            w.save(meta)
        sched.build_meta(output(finished={"a"}))

        # The same prompt again: admitted with the store hit (96 tokens) ...
        req = request("b", hashes, 100)
        assert sched.matched_tokens(req, 0) == 96
        sched.after_alloc(req, [7, 8, 9, 10], 96)
        meta = sched.build_meta(output([new_request("b", [7, 8, 9, 10], 96)],
                                       scheduled={"b": 4}))
        assert transfers(meta.loads) == [(keys, [7, 8, 9])] and meta.saves == []
        # ... preempted (its blocks freed), and resumed into other blocks: vLLM looks the
        # prefix up again and counts the hit as computed.
        assert sched.matched_tokens(req, 0) == 96
        sched.after_alloc(req, [3, 2, 1, 0], 96)
        resumed = sched.build_meta(output(
            cached=cached_request("b", [3, 2, 1, 0], 96, resumed=True), scheduled={"b": 4}))
        assert transfers(resumed.loads) == [(keys, [3, 2, 1])]
        assert resumed.saves == []  # a step that loads saves nothing
        # Its next step (decode) loads nothing and schedules its full blocks from block 0.
        after = sched.build_meta(output(cached=cached_request("b", None, 100, resumed=False),
                                        scheduled={"b": 1}))
        assert after.loads == [] and transfers(after.saves) == [(keys, [3, 2, 1])]
        meta = sched.build_meta(output(cached=cached_request("b", None, 101, resumed=False),
                                       scheduled={"b": 1}))
        assert meta.loads == [] and meta.saves == []  # scheduled once
    finally:
        sched.close()

    dst = caches(seed=2, zero=True)
    with worker_side(plan, dst) as w:
        assert load(w, resumed) == set()
        w.save(after)
        w._reap_saves(wait=True)
        stats = w.mover.stats()  # the store holds every key: nothing is sent
        assert stats.pages_put == 0 and stats.statuses[kvmove.Status.EXISTS] == 3
    assert [block_bytes(dst, b) for b in (3, 2, 1)] == [block_bytes(src, b) for b in (7, 8, 9)]


def test_blocks_from_vllms_own_prefix_cache_are_saved_when_the_store_lacks_them():
    """A request whose first blocks vLLM's local prefix cache supplied (computed tokens, no
    store hit) schedules its full blocks from block 0, as vLLM's connector does; the worker
    puts those the store lacks (a prefix block that left the store is stored again), and
    sends none of the others (``EXISTS``; the stored object stays)."""
    plan = plan_for()
    hashes = block_hashes("local-prefix", 3)
    keys = [h.hex() for h in hashes]
    src = caches(seed=3)
    with worker_side(plan, src) as w:  # block 1 is in the store already
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", [keys[1]], [5], 1)]))
    sched = SchedulerSide(plan)
    try:
        req = request("c", hashes, 100)
        assert sched.matched_tokens(req, 64) == 0  # the store lacks block 0: no hit
        sched.after_alloc(req, [4, 5, 6, 11], 0)
        meta = sched.build_meta(output([new_request("c", [4, 5, 6, 11], 64)],
                                       scheduled={"c": 36}))
        assert meta.loads == [] and transfers(meta.saves) == [(keys, [4, 5, 6])]
    finally:
        sched.close()
    with worker_side(plan, src) as w:
        w.save(meta)
        w._reap_saves(wait=True)
        stats = w.mover.stats()
        assert stats.pages_put == 2  # blocks 0 and 2; block 1 was there ...
        assert stats.statuses[kvmove.Status.EXISTS] == 1  # ... and was not sent
    dst = caches(seed=4, zero=True)
    with worker_side(plan, dst) as w:
        assert load(w, KVMoveConnectorMetadata(loads=[BlockTransfer("d", keys, [0, 1, 2])])) \
            == set()
    assert [block_bytes(dst, b) for b in (0, 1, 2)] == [block_bytes(src, b) for b in (4, 5, 6)]


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_blocks_the_lookup_did_not_find_are_saved_without_the_exists_query(path):
    """Blocks a request's lookup found in no namespace are saved without asking the store
    which exist (one master request less); a step that saves a block the store held at
    lookup asks, and that block is not sent again. The bytes are the same either way."""
    plan = plan_for(path)
    hashes = block_hashes(f"absent-{path}", 4)
    keys = [h.hex() for h in hashes]
    fresh = {r: block_hashes(f"fresh-{r}-{path}", 2) for r in "fg"}
    src = caches(seed=7)
    with worker_side(plan, src) as w:  # block 1 is in the store already
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", [keys[1]], [5], 1)]))
    sched = SchedulerSide(plan)
    try:
        for r, ids in (("f", [0, 1, 2]), ("g", [9, 10, 11])):
            assert sched.matched_tokens(request(r, fresh[r], 2 * BS + 1), 0) == 0
            sched.after_alloc(request(r, fresh[r], 2 * BS + 1), ids, 0)
        req = request("h", hashes, 4 * BS + 1)
        assert sched.matched_tokens(req, 0) == 0  # block 0 is missing: no hit
        sched.after_alloc(req, [4, 5, 6, 7, 8], 0)
        steps = [
            sched.build_meta(output([new_request("f", [0, 1, 2], 0)],
                                    scheduled={"f": 2 * BS + 1})),
            # a step with a save of blocks not known absent (h's block 0) asks for all
            sched.build_meta(output([new_request("h", [4, 5, 6, 7, 8], 0),
                                     new_request("g", [9, 10, 11], 0)],
                                    scheduled={"h": BS + 1, "g": 2 * BS + 1})),
            sched.build_meta(output(cached=cached_request("h", None, BS + 1, resumed=False),
                                    scheduled={"h": BS})),  # block 1, held at lookup
            sched.build_meta(output(cached=cached_request("h", None, 2 * BS + 1,
                                                          resumed=False),
                                    scheduled={"h": 2 * BS})),  # blocks 2 and 3
        ]
    finally:
        sched.close()
    assert [[(t.first_block, t.absent_at_lookup) for t in m.saves] for m in steps] == \
        [[(0, True)], [(0, False), (0, True)], [(1, False)], [(2, True)]]
    with worker_side(plan, src) as w:
        client = swap_client(w.store, SlowClient)
        for meta, want in zip(steps, ([PUT], [CHECK, PUT], [CHECK], [PUT]), strict=True):
            client.calls.clear()
            w.save(meta)
            w._reap_saves(wait=True)
            assert client.names() == want  # block 1 exists: nothing left to put
        stats = w.mover.stats()
        assert stats.pages_put == 7 and stats.statuses[kvmove.Status.EXISTS] == 1
    dst = caches(seed=8, zero=True)
    with worker_side(plan, dst) as w:
        got = KVMoveConnectorMetadata(loads=[
            BlockTransfer("d", keys, [12, 13, 14, 15]),
            BlockTransfer("e", [h.hex() for r in "fg" for h in fresh[r]], [3, 4, 5, 6])])
        assert load(w, got) == set()
    assert [block_bytes(dst, b) for b in (12, 13, 14, 15, 3, 4, 5, 6)] == \
        [block_bytes(src, b) for b in (4, 5, 6, 7, 0, 1, 9, 10)]


def test_the_absent_blocks_are_those_no_namespace_holds_past_the_last_held():
    """The lookup's answer over several namespaces (TP ranks with their own keys): a block
    one namespace holds is not absent, nor any block before it; a later lookup of the
    request that does not reach the store leaves no answer behind."""
    plan = ConnectorPlan(block_size=BS, hash_block_size=BS, keys=VLLMKeyFormat("tp2"),
                         tp_size=2, pp_size=1, replication=1, can_load=True, can_save=True,
                         save_decode=False, layerwise=False, load_async=False,
                         staging_bytes=1 << 20, path="staged")
    assert len(plan.lookup_namespaces()) == 2
    sched = SchedulerSide(plan)
    try:
        req = request("t", block_hashes("tp2", 5), 5 * BS + 1)
        # namespace 0 holds blocks 0 and 1, namespace 1 blocks 0 and 2: hit 1, absent 3..5
        held = {(0, 0), (0, 1), (1, 0), (1, 2)}
        sched.store.exists = lambda keys: [(j, p) in held for j in range(2) for p in range(5)]
        assert sched.matched_tokens(req, 0) == BS
        assert sched._absent["t"] == (3, 5)
        sched.store.exists = lambda keys: [False] * len(keys)
        assert sched.matched_tokens(req, 0) == 0
        assert sched._absent["t"] == (0, 5)
        assert sched.matched_tokens(req, 5 * BS) == 0  # nothing looked up
        assert "t" not in sched._absent
    finally:
        sched.close()


def test_a_step_that_loads_saves_nothing_then_its_blocks_are_saved_from_the_first():
    """vLLM's rule: a step that loads a request's blocks saves none of them (a failed load
    would have its new tokens computed over bad KV, and stored under good keys); the next
    step schedules every full block from block 0, the loaded ones (the store has them) and
    the ones computed over them."""
    plan = plan_for()
    hashes = block_hashes("load-then-save", 4)
    keys = [h.hex() for h in hashes]
    src = caches(seed=5)
    with worker_side(plan, src) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys[:2], [1, 2], 0)]))
    sched = SchedulerSide(plan)
    try:
        req = request("e", hashes, 130)
        assert sched.matched_tokens(req, 0) == 64
        sched.after_alloc(req, [8, 9, 10, 11, 12], 64)
        first = sched.build_meta(output([new_request("e", [8, 9, 10, 11, 12], 64)],
                                        scheduled={"e": 66}))
        assert transfers(first.loads) == [(keys[:2], [8, 9])] and first.saves == []
        second = sched.build_meta(output(cached=cached_request("e", None, 130, resumed=False),
                                         scheduled={"e": 1}))
        assert second.loads == [] and transfers(second.saves) == [(keys, [8, 9, 10, 11])]
    finally:
        sched.close()


def test_an_eagle_hit_gives_up_its_last_block():
    """With EAGLE-like speculative decoding vLLM drops the last block of a prefix hit (its
    draft KV was made with the token after it): so does the connector's lookup, whole hits
    and hits capped at the last token alike."""
    plan, eagle = plan_for(), dataclasses.replace(plan_for(), eagle_block_drop=True)
    hashes = block_hashes("eagle", 3)
    with worker_side(plan, caches(seed=6)) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer(
            "x", [h.hex() for h in hashes], [1, 2, 3], 0)]))
    for p, longer, capped in ((plan, 96, 64), (eagle, 64, 64)):
        sched = SchedulerSide(p)
        try:
            assert sched.matched_tokens(request("f", hashes, 200), 0) == longer
            # a 96-token prompt: vLLM computes its last token, so 2 blocks (with EAGLE too)
            assert sched.matched_tokens(request("g", hashes, 96), 0) == capped
            assert sched.matched_tokens(request("h", hashes, 200), 64) == longer - 64
        finally:
            sched.close()


def plan_of(extra: dict, speculative=None, pp: int = 1,
            launcher: tuple[str, int] = ("mp", 1)) -> ConnectorPlan:
    """``plan_from_vllm`` of a one-group full-attention model at TP 1 and PP ``pp`` with the
    connector's ``kv_connector_extra_config`` ``extra``; ``launcher``: vLLM's
    ``distributed_executor_backend`` and ``world_size``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvmove.integrations.vllm.plan import plan_from_vllm

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=pp,
                                        prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        distributed_executor_backend=launcher[0],
                                        world_size=launcher[1]),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2, model="org/tiny"),
        cache_config=SimpleNamespace(block_size=BS, prefix_match_unit=None),
        speculative_config=speculative)
    kv_cache_config = SimpleNamespace(hisparse_host_num_blocks=None, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=NAMES)])
    return plan_from_vllm(vllm_config, kv_cache_config)


@pytest.mark.parametrize("eagle", [None, True, False])
def test_the_plan_follows_vllms_eagle_block_drop(eagle):
    speculative = None if eagle is None else SimpleNamespace(
        use_eagle_block_drop=lambda: eagle)  # vLLM's method: EAGLE-like, drop not disabled
    assert plan_of({}, speculative).eagle_block_drop is bool(eagle)


@pytest.mark.parametrize(("extra", "load_async", "layerwise"), [
    ({}, True, False),  # vLLM's default: asynchronous loads, nothing waits in the forward
    ({"load_async": True, "layerwise": "true"}, True, False),
    ({"load_async": "false"}, False, True),  # layer-wise loads wait between graph pieces
    ({"load_async": False, "layerwise": "false"}, False, False),
])
def test_loads_are_asynchronous_unless_configured_off(extra, load_async, layerwise):
    from kvmove.integrations.vllm import KVMoveConnector

    plan = plan_of(extra)
    assert (plan.load_async, plan.layerwise) == (load_async, layerwise)
    assert KVMoveConnector.requires_piecewise_for_cudagraph(extra) is layerwise
    # Pipeline stages before the last may report no finished loads; ranks under
    # external_launcher schedule alone: loads in the step, and layer-wise only where the
    # graph was split for them.
    for plan in (plan_of(extra, pp=2),
                 plan_of(extra, launcher=("external_launcher", 2)),
                 plan_of(extra, pp=2, launcher=("mp", 2))):
        assert (plan.load_async, plan.layerwise) == (False, layerwise)
    assert plan_of(extra, launcher=("external_launcher", 1)).load_async is load_async


def test_an_asynchronous_load_is_scheduled_while_its_request_waits():
    """With asynchronous loads vLLM does not schedule a request with a store hit in the
    step that allocates its blocks (it waits in WAITING_FOR_REMOTE_KVS): that step's
    metadata carries its load all the same, once. Scheduled after the load (allocated
    again, with no lookup in between), it loads nothing more and saves its blocks from the
    first; a later save of blocks its lookup found absent still goes without the query."""
    plan = plan_for(load_async=True)
    hashes = block_hashes("async-sched", 4)
    keys = [h.hex() for h in hashes]
    with worker_side(plan, caches(seed=11)) as w:  # blocks 0 and 1 are stored
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys[:2], [1, 2], 0)]))
    sched = SchedulerSide(plan)
    try:
        req = request("a", hashes, 4 * BS + 1)
        assert sched.matched_tokens(req, 0) == 2 * BS
        sched.after_alloc(req, [5, 6], 2 * BS)  # the hit's blocks
        other = sched.build_meta(output([new_request("o", [0], 0)], scheduled={"o": 7}))
        assert transfers(other.loads) == [(keys[:2], [5, 6])] and other.saves == []
        assert sched.build_meta(output()).loads == []  # once
        sched.after_alloc(req, [5, 6, 7, 8, 9], 0)  # its load ended: vLLM schedules it
        first = sched.build_meta(output([new_request("a", [5, 6, 7, 8, 9], 2 * BS)],
                                        scheduled={"a": 1}))
        later = sched.build_meta(output(cached=cached_request("a", None, 2 * BS + 1,
                                                              resumed=False),
                                        scheduled={"a": 2 * BS}))
    finally:
        sched.close()
    assert first.loads == [] and later.loads == []
    assert [(t.first_block, t.block_ids, t.absent_at_lookup) for t in first.saves] == \
        [(0, [5, 6], False)]
    assert [(t.first_block, t.block_ids, t.absent_at_lookup) for t in later.saves] == \
        [(2, [7, 8], True)]


@pytest.mark.parametrize(("failed", "hit_after"), [(0, 0), (1, 1), (None, 3)])
def test_a_lookup_after_a_failed_asynchronous_load_stops_before_the_failed_block(failed,
                                                                                hit_after):
    """A request whose asynchronous load failed at its first block goes back to vLLM's queue
    with nothing computed and is looked up again: its hit stops before the failed block
    (else it would load the same failing object forever) until vLLM admits it (a lookup
    after that sees the store again). A load that ended well changes nothing."""
    plan = plan_for(load_async=True)
    hashes = block_hashes(f"async-retry-{failed}", 3)
    keys = [h.hex() for h in hashes]
    with worker_side(plan, caches(seed=16)) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys, [1, 2, 3], 0)]))
    from kvmove.integrations.vllm import KVMoveConnector

    sched = SchedulerSide(plan)
    connector = KVMoveConnector.__new__(KVMoveConnector)  # vLLM's calls, on this side
    connector.plan, connector._side = plan, sched

    def done(finished, invalid):
        connector.update_connector_output(SimpleNamespace(
            kv_connector_worker_meta=None, finished_recving=finished,
            invalid_block_ids=invalid))

    try:
        req = request("r", hashes, 3 * BS + 1)
        assert connector.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
        sched.after_alloc(req, [9, 7, 5], 3 * BS)
        meta = sched.build_meta(output())
        assert transfers(meta.loads) == [(keys, [9, 7, 5])]
        invalid = {[9, 7, 5][failed], 5} if failed is not None else set()
        done(None, invalid)  # vLLM may report errors before the request
        done({"r"}, set())
        done(None, {9, 7, 5})  # blocks of a load that ended: not this one's
        want = (hit_after * BS, True) if hit_after else (0, False)
        assert connector.get_num_new_matched_tokens(req, 0) == want
        # a lookup vLLM did not admit (no free blocks, prefills deferred): the same
        assert connector.get_num_new_matched_tokens(req, 0) == want
        sched.after_alloc(req, [9, 7, 5, 3], want[0])  # admitted with it
        sched.build_meta(output())
        assert connector.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    finally:
        sched.close()


def finish_async(side: WorkerSide, timeout: float = 30.0) -> list[tuple[set[str], set[int]]]:
    """Poll a worker's asynchronous loads as vLLM does after each step (``get_finished``,
    then ``get_block_ids_with_load_errors``) until none is in flight: per pass that
    finished requests, those requests and the load errors reported since the previous such
    pass (vLLM takes a request's errors up to the pass that reports it, never after)."""
    passes, errors, deadline = [], set(), time.monotonic() + timeout
    while side._recving:
        assert time.monotonic() < deadline, "asynchronous loads did not finish"
        finished = side.finished_loads()
        errors |= side.take_load_errors()
        if finished:
            passes.append((finished, errors))
            errors = set()
        time.sleep(0.002)
    assert errors == set() and side.take_load_errors() == set()  # none after the requests
    return passes


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_asynchronous_loads_finish_with_their_blocks_in(path):
    """An asynchronous load returns at once (nothing waits in the forward); its requests are
    reported finished once their blocks are in the KV cache, and a block that failed is
    reported in that same pass, never after."""
    plan = plan_for(path, load_async=True)
    hashes = block_hashes(f"async-load-{path}", 3)
    keys = [h.hex() for h in hashes]
    src = caches(seed=12)
    with worker_side(plan, src) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys, [1, 2, 3], 0)]))
    missing = block_hashes(f"async-missing-{path}", 1)[0].hex()
    dst = caches(seed=13, zero=True)
    meta = KVMoveConnectorMetadata(loads=[BlockTransfer("a", keys, [8, 9, 10]),
                                          BlockTransfer("b", [keys[0], missing], [11, 12])])
    with worker_side(plan, dst) as w:
        w.start_load(meta)
        assert w._loads == []  # nothing for wait_for_layer
        assert finish_async(w) == [({"a", "b"}, {12})]
        assert w.finished_loads() == set() and w.take_load_errors() == set()
    saved = [block_bytes(src, b) for b in (1, 2, 3)]
    assert [block_bytes(dst, b) for b in (8, 9, 10, 11)] == [*saved, saved[0]]
    assert block_bytes(dst, 12) == bytes(len(saved[0]))


def test_a_load_whose_second_round_cannot_start_finishes_after_its_first(monkeypatch):
    """Two requests with the same prefix load in two rounds; the second cannot start: its
    blocks fail at once, but the requests are reported finished only once the first round,
    still writing its blocks, has ended (vLLM frees or recomputes them then)."""
    plan = plan_for("in_place", load_async=True)
    keys = [h.hex() for h in block_hashes("async-rounds", 2)]
    src = caches(seed=17)
    with worker_side(plan, src) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys, [1, 2], 0)]))
    dst = caches(seed=18, zero=True)
    with worker_side(plan, dst) as w:
        get, prefetch, started = w.store.get, w.mover.prefetch, []
        ended = threading.Event()

        def slow_get(*args, **kwargs):
            time.sleep(0.5)
            try:
                return get(*args, **kwargs)
            finally:
                ended.set()

        def second_fails(*args, **kwargs):
            started.append(args[0])
            if len(started) > 1:
                raise RuntimeError("round 2 cannot start")
            return prefetch(*args, **kwargs)

        monkeypatch.setattr(w.store, "get", slow_get)
        monkeypatch.setattr(w.mover, "prefetch", second_fails)
        w.start_load(KVMoveConnectorMetadata(loads=[BlockTransfer("a", keys, [4, 5]),
                                                    BlockTransfer("b", keys, [6, 7])]))
        assert w.finished_loads() == set() and not ended.is_set()
        assert finish_async(w) == [({"a", "b"}, {6, 7})]
        assert ended.is_set()
    assert [block_bytes(dst, b) for b in (4, 5)] == [block_bytes(src, b) for b in (1, 2)]
    assert block_bytes(dst, 6) == bytes(len(block_bytes(dst, 6)))


def test_a_save_never_waits_for_staging_an_asynchronous_load_holds(caplog):
    """Staged: an asynchronous load may hold staging slots across steps. A save that finds
    none free is skipped (a later miss), never waits in the engine's step."""
    plan = plan_for("staged", load_async=True)
    hashes = block_hashes("async-staging", 2)
    with worker_side(plan, caches(seed=19)) as w:
        held = w.mover.staging.alloc(w.mover.staging.num_slots)
        threading.Timer(0.5, w.mover.staging.free, args=(held,)).start()
        with caplog.at_level("WARNING"):
            w.save(KVMoveConnectorMetadata(saves=[BlockTransfer(
                "a", [h.hex() for h in hashes], [4, 5])]))
        assert "2 block saves skipped" in caplog.text and w._saves == []


@pytest.mark.parametrize("where", ["start", "background", "no cache"])
def test_an_asynchronous_load_that_fails_still_finishes_its_requests(where, monkeypatch):
    """A load that cannot start, whose background job raises, or that has no KV cache to
    land in fails all its blocks (vLLM recomputes them) and still reports its requests
    finished: a request is never left waiting for its blocks."""
    plan = plan_for(load_async=True)
    keys = [h.hex() for h in block_hashes(f"async-fail-{where}", 3)]
    with worker_side(plan, caches(seed=14)) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("x", keys, [1, 2, 3], 0)]))
    dst = caches(seed=15, zero=True)
    with worker_side(plan, dst) as w:
        if where == "start":
            monkeypatch.setattr(w.mover, "prefetch", lambda *a, **k: 1 / 0)
        elif where == "background":
            path = w.mover._prefetch_path  # the background job's get, on either path
            get = "_get_piece" if hasattr(path, "_get_piece") else "_get"
            monkeypatch.setattr(path, get, lambda *a, **k: 1 / 0)
        else:
            mover, w.mover = w.mover, None
        w.start_load(KVMoveConnectorMetadata(loads=[BlockTransfer("a", keys[:2], [4, 5]),
                                                    BlockTransfer("b", keys[2:], [6])]))
        assert finish_async(w) == [({"a", "b"}, {4, 5, 6})]
        if where == "no cache":
            w.mover = mover
    assert all(block_bytes(dst, b) == bytes(len(block_bytes(dst, b))) for b in (4, 5, 6))


@pytest.mark.parametrize("path,layerwise", [("staged", True), ("in_place", False)])
def test_requests_with_the_same_blocks_in_one_step(path, layerwise):
    """Two requests with the same prompt in one step (vLLM's prefix cache off) save the same
    keys from different blocks and load the same keys into different blocks: each key is
    saved once, from its first block; every block is loaded, and a key that is missing fails
    every block it was to fill."""
    plan = plan_for(path, layerwise)
    hashes = block_hashes(f"same-{path}", 3)
    keys = [h.hex() for h in hashes]
    src = caches(seed=3)
    with worker_side(plan, src) as w:
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("a", keys, [1, 2, 3]),
                                              BlockTransfer("b", keys, [4, 5, 6])]))
    assert block_bytes(src, 1) != block_bytes(src, 4)  # which block was saved shows

    missing = block_hashes(f"missing-{path}", 1)[0].hex()
    dst = caches(seed=4, zero=True)
    meta = KVMoveConnectorMetadata(loads=[BlockTransfer("c", [*keys, missing], [8, 9, 10, 11]),
                                          BlockTransfer("d", [*keys, missing], [12, 13, 14, 15])])
    with worker_side(plan, dst) as w:
        assert load(w, meta) == {11, 15}
    saved = [block_bytes(src, b) for b in (1, 2, 3)]
    assert [block_bytes(dst, b) for b in (8, 9, 10)] == saved
    assert [block_bytes(dst, b) for b in (12, 13, 14)] == saved
    zeros = bytes(len(saved[0]))
    assert block_bytes(dst, 11) == zeros and block_bytes(dst, 15) == zeros



def test_a_tenants_blocks_are_its_own(tmp_path, monkeypatch):
    """On a master that keeps tenants apart, the blocks the connector saves with vLLM's JSON
    naming ``tenant_id`` (padded, as vLLM strips it) live in that tenant's key space: a
    client of the tenant and the connector's scheduler of the tenant see them, its worker
    loads them byte-exact; the default tenant (a client, or a connector whose JSON names no
    tenant) does not see them."""
    default = multi_tenant_store(tmp_path)
    try:
        def use(**tenant):
            config = tmp_path / "tenant.json"
            config.write_text(json.dumps({
                "master_server_address": default.address, "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                "global_segment_size": 0, "local_buffer_size": "64mb", **tenant}))
            monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))

        use(tenant_id=" team-a ")
        plan = plan_for()
        hashes = block_hashes("tenant", 3)
        src = caches(seed=5)
        with worker_side(plan, src) as w:
            assert w.store.config.tenant_id == "team-a"
            w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("a", [h.hex() for h in hashes],
                                                                [1, 2, 3])]))
        keys = [f"{plan.keys.prefix(RankNamespace(tp_rank=0, pp_rank=0))}@{h.hex()}"
                for h in hashes]
        team = kvmove.MooncakeStore(kvmove.StoreConfig(
            master_address=default.address, tenant_id="team-a", global_segment_size=0))
        try:
            assert team.exists(keys) == [True] * 3
        finally:
            team.close()
        assert default.exists(keys) == [False] * 3  # the default tenant's key space

        sched = SchedulerSide(plan)
        try:
            assert sched.store.config.tenant_id == "team-a"
            assert sched.matched_tokens(request("b", hashes, 100), 0) == 96
        finally:
            sched.close()
        dst = caches(seed=6, zero=True)
        meta = KVMoveConnectorMetadata(loads=[BlockTransfer("b", [h.hex() for h in hashes],
                                                            [4, 5, 6])])
        with worker_side(plan, dst) as w:
            assert load(w, meta) == set()
        assert [block_bytes(dst, b) for b in (4, 5, 6)] == \
            [block_bytes(src, b) for b in (1, 2, 3)]

        use()  # no tenant_id: the default tenant
        sched = SchedulerSide(plan)
        try:
            assert sched.store.config.tenant_id == "default"
            assert sched.matched_tokens(request("c", hashes, 100), 0) == 0
        finally:
            sched.close()
    finally:
        default.close()


@pytest.mark.parametrize("ids", [[], [7], [511, 3, 0, 42]])
def test_block_pages_are_the_block_ids_as_one_token_pages(ids):
    pages = block_pages(ids)
    assert pages.dtype == np.int64 and tuple(pages.shape) == (len(ids), 1)
    assert pages.reshape(-1).tolist() == ids
    ids.append(99)  # the caller's list is not the array's memory
    assert pages.shape[0] == len(ids) - 1


def test_unique_rounds_split_repeated_keys():
    assert unique_rounds([]) == []
    assert unique_rounds(["a", "b"]) == [[0, 1]]
    assert unique_rounds(["a", "b", "a", "a", "c", "b"]) == [[0, 1, 4], [2, 5], [3]]


class RecordingMover:
    """Stands in for a worker's mover: records what it is asked to save and load."""

    def __init__(self):
        self.saved: list[str] = []
        self.loaded: list[str] = []

    def evict(self, keys, pages, detect_exists=None, wait_for_staging=True):
        self.saved += keys
        return SimpleNamespace(gathered=SimpleNamespace(wait=lambda: None), done=lambda: True,
                               wait=lambda: [kvmove.Status.OK] * len(keys))

    def prefetch(self, keys, pages, layerwise):
        self.loaded += keys
        return SimpleNamespace(wait=lambda: [kvmove.Status.OK] * len(keys),
                               scattered=SimpleNamespace(wait=lambda: None))

    def close(self):
        pass


@pytest.mark.parametrize("replication", [4, 2])  # MLA at TP 4; GQA, 2 KV heads at TP 4
def test_replicated_ranks_save_each_block_once(monkeypatch, replication):
    """TP ranks that hold the same blocks (one key namespace) take turns saving them, as
    vLLM's MooncakeStoreConnector does: across a chunked prefill (the second step's blocks
    start at position 3) each block of each namespace is saved exactly once, by the rank
    vLLM's rule picks; every rank still loads every block."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        ChunkedTokenDatabase,
        KeyMetadata,
    )

    tp = 4
    plan = ConnectorPlan(block_size=BS, hash_block_size=BS, keys=VLLMKeyFormat("ds"),
                         tp_size=tp, pp_size=1, replication=replication, can_load=True,
                         can_save=True, save_decode=False, layerwise=False, load_async=False,
                         staging_bytes=1 << 20, path="staged")
    hashes = block_hashes(f"tp-{replication}", 7)
    block_ids = [9, 3, 7, 1, 12, 5, 0, 2]
    sched = SchedulerSide(plan)
    try:
        req = request("a", hashes, 7 * BS + 5)
        assert sched.matched_tokens(req, 0) == 0
        sched.after_alloc(req, block_ids, 0)
        steps = [sched.build_meta(output([new_request("a", block_ids, 0)],
                                         scheduled={"a": 100})),
                 sched.build_meta(output(cached=cached_request("a", None, 100, resumed=False),
                                         scheduled={"a": 7 * BS + 5 - 100}))]
    finally:
        sched.close()
    assert [(t.first_block, len(t.keys)) for m in steps for t in m.saves] == [(0, 3), (3, 4)]

    saved: dict[int, list[str]] = {}
    loaded: dict[int, list[str]] = {}
    load = KVMoveConnectorMetadata(loads=[BlockTransfer("b", [h.hex() for h in hashes[:5]],
                                                        block_ids[:5])])
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda r=rank: r)
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            rank=rank, tensor_parallel_size=tp, pipeline_parallel_size=1))
        kv_cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
            SimpleNamespace(layer_names=NAMES)])
        side = WorkerSide(plan, vllm_config, kv_cache_config)
        side.mover = mover = RecordingMover()
        try:
            for meta in steps:
                side.save(meta)
            side.start_load(load)
        finally:
            side.close()
        saved[rank], loaded[rank] = mover.saved, mover.loaded
        # vLLM's rule (store/worker.py, data.py process_tokens): put_step = the replication
        # factor, put_step_rank = (tp_rank + group) % put_step, by the block's position.
        db = ChunkedTokenDatabase(KeyMetadata(model_name="ds", tp_rank=rank // replication,
                                              pcp_rank=0, dcp_rank=0, pp_rank=0), BS)
        expected = [db.key_for(h) for _, _, h in db.process_tokens(
            7 * BS, hashes, put_step=replication, put_step_rank=rank % replication)]
        assert saved[rank] == expected
        ns = plan.keys.prefix(RankNamespace(tp_rank=rank // replication, pp_rank=0))
        assert loaded[rank] == [f"{ns}@{h.hex()}" for h in hashes[:5]]

    every = [k for keys in saved.values() for k in keys]
    assert len(every) == len(set(every))  # no block saved twice
    assert set(every) == {f"{plan.keys.prefix(ns)}@{h.hex()}"
                          for ns in plan.lookup_namespaces() for h in hashes}


def test_a_save_without_staging_slots_is_skipped_not_raised(monkeypatch, caplog):
    """The staging has no free slots (puts in flight, a stalled store): the step's saves are
    skipped with a warning (those blocks are recomputed on a later miss); vLLM's step does
    not die."""
    import vllm.distributed.parallel_state as parallel_state

    class FullMover(RecordingMover):
        def evict(self, keys, pages, detect_exists=None, wait_for_staging=True):
            raise kvmove.StagingFull("no staging slots came free within 60 s")

    plan = ConnectorPlan(block_size=BS, hash_block_size=BS, keys=VLLMKeyFormat("ds"),
                         tp_size=1, pp_size=1, replication=1, can_load=True, can_save=True,
                         save_decode=False, layerwise=False, load_async=False,
                         staging_bytes=1 << 20, path="staged")
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        rank=0, tensor_parallel_size=1, pipeline_parallel_size=1))
    kv_cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(layer_names=NAMES)])
    side = WorkerSide(plan, vllm_config, kv_cache_config)
    side.mover = FullMover()
    hashes = block_hashes("full", 2)
    try:
        with caplog.at_level("WARNING"):
            side.save(KVMoveConnectorMetadata(saves=[BlockTransfer(
                "a", [h.hex() for h in hashes], [4, 5])]))
        assert "2 block saves skipped" in caplog.text
        assert side._saves == []
    finally:
        side.close()


def _block_pool():
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=BS)


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_a_save_holds_its_blocks_until_every_worker_reported_its_put_done(path, monkeypatch):
    """Once vLLM bound its block pool, a step's saves are one job holding a reference on
    each block; the worker's save returns without waiting for its put (here stalled), the
    job is reported done only once the put has ended, and the blocks go back to vLLM's pool
    when the last of the workers reported it. The bytes stored are the blocks'."""
    plan = plan_for(path)
    pool = _block_pool()
    hashes = block_hashes(f"held-{path}", 3)
    keys = [h.hex() for h in hashes]
    src = caches(seed=11)
    sched = SchedulerSide(plan, workers=2)
    sched.bind_pool(pool)
    try:
        blocks = pool.get_new_blocks(4)  # the request's, one reference each
        ids = [b.block_id for b in blocks]
        req = request("h", hashes, 3 * BS + 4)
        sched.after_alloc(req, ids, 0)
        meta = sched.build_meta(output([new_request("h", ids, 0)], scheduled={"h": 3 * BS + 4}))
        assert transfers(meta.saves) == [(keys, ids[:3])] and meta.save_job is not None
        assert [b.ref_cnt for b in blocks] == [2, 2, 2, 1]
        assert sched.holds_blocks()
        with worker_side(plan, src) as w:
            release = threading.Event()
            real_put = w.mover.store.put

            def stalled_put(desc, **kwargs):
                assert release.wait(30)
                return real_put(desc, **kwargs)

            monkeypatch.setattr(w.mover.store, "put", stalled_put)
            monkeypatch.setattr(w.mover.store, "begin_put", None)
            t0 = time.monotonic()
            w.save(meta)  # returns with the put stalled
            assert time.monotonic() - t0 < 5
            assert w.done_saves() is None  # not done: not reported
            release.set()
            deadline = time.monotonic() + 30
            report = None
            while report is None and time.monotonic() < deadline:
                report = w.done_saves()
                time.sleep(0.01)
            assert report is not None and report.done_saves == {meta.save_job: 1}
            assert w.done_saves() is None  # reported once
        sched.saves_done(report)  # one worker of two
        assert [b.ref_cnt for b in blocks] == [2, 2, 2, 1] and sched.holds_blocks()
        second = KVMoveWorkerMetadata({meta.save_job: 1})
        sched.saves_done(KVMoveWorkerMetadata().aggregate(second))
        assert [b.ref_cnt for b in blocks] == [1, 1, 1, 1] and not sched.holds_blocks()
        pool.free_blocks(blocks)  # the request ends: every block is free again
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1  # vLLM's null block aside
    finally:
        sched.close()
    dst = caches(seed=12, zero=True)
    with worker_side(plan, dst) as w:
        assert load(w, KVMoveConnectorMetadata(loads=[BlockTransfer("d", keys, [0, 1, 2])])) \
            == set()
    assert [block_bytes(dst, b) for b in (0, 1, 2)] == [block_bytes(src, b) for b in ids[:3]]


def test_a_save_job_is_reported_even_when_the_worker_saves_nothing_of_it():
    """A job this worker has no share of (or no mover for) is done at once: its blocks
    must not stay held."""
    plan = plan_for()
    with worker_side(plan, caches(seed=13)) as w:
        w.save(KVMoveConnectorMetadata(save_job=7))
        assert w.done_saves().done_saves == {7: 1}
    sched = SchedulerSide(plan)  # no pool bound (an older vLLM): nothing held
    try:
        req = request("n", block_hashes("unbound", 1), BS + 1)
        sched.after_alloc(req, [3, 4], 0)
        meta = sched.build_meta(output([new_request("n", [3, 4], 0)], scheduled={"n": BS + 1}))
        assert len(meta.saves) == 1 and meta.save_job is None and not sched.holds_blocks()
    finally:
        sched.close()


@pytest.mark.parametrize(("backend", "world", "pp", "want"), [
    ("mp", 4, 1, (4, True)), (None, 1, 1, (1, True)),
    ("external_launcher", 8, 1, (1, True)),  # each engine hears its own worker only
    ("mp", 4, 2, (4, False)), ("ray", 4, 2, (4, False))])  # earlier stages may not report
def test_who_reports_save_jobs(backend, world, pp, want):
    from kvmove.integrations.vllm.connector import _save_reports

    par = SimpleNamespace(distributed_executor_backend=backend, world_size=world,
                          pipeline_parallel_size=pp)
    assert _save_reports(par) == want


def test_a_scheduler_that_does_not_hold_blocks_ignores_the_pool():
    plan = plan_for()
    pool = _block_pool()
    sched = SchedulerSide(plan, workers=2, hold_blocks=False)
    sched.bind_pool(pool)
    try:
        blocks = pool.get_new_blocks(2)
        ids = [b.block_id for b in blocks]
        sched.after_alloc(request("p", block_hashes("pp", 1), BS + 1), ids, 0)
        meta = sched.build_meta(output([new_request("p", ids, 0)], scheduled={"p": BS + 1}))
        assert len(meta.saves) == 1 and meta.save_job is None
        assert [b.ref_cnt for b in blocks] == [1, 1] and not sched.holds_blocks()
    finally:
        sched.close()
