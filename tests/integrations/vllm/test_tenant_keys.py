"""Tenant-safe keys and load errors through the vLLM connector's two sides, against a real
Mooncake store: requests of two tenants (their ``cache_salt``, or the connector's
``tenant``) with identical block hashes never read each other's blocks; a request with no
tenant keeps vLLM's own keys; one failed key of a request whose blocks span several buffers
(head-outermost regions) fails exactly its block. Asserts the bytes in the blocks."""

from __future__ import annotations

import dataclasses
import uuid
from types import SimpleNamespace

import pytest

from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata
from kvmove.integrations.vllm.plan import BlockTransfer
from kvmove.integrations.vllm.scheduler import SchedulerSide
from tests.integrations.vllm.caches import vllm_layer_caches
from tests.integrations.vllm.test_connector import (  # noqa: F401 (connector_env: autouse)
    BS,
    LAYERS,
    NUM_BLOCKS,
    block_bytes,
    block_hashes,
    caches,
    connector_env,
    load,
    new_request,
    output,
    plan_for,
    worker_side,
)

RANKS = RankNamespace()


def salted(req_id: str, hashes: list[bytes], salt: str | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_tokens=100, num_prompt_tokens=100,
                           block_hashes=hashes, cache_salt=salt)


def with_keys(plan, **extra):
    """``plan`` with the keys the connector makes of ``kv_connector_extra_config``."""
    return dataclasses.replace(plan, keys=plan.keys.with_tenant(extra))


def save_request(plan, req, src) -> list[str]:
    """Schedule and save ``req``'s three full blocks (vLLM blocks 1, 2, 3); their keys."""
    sched = SchedulerSide(plan)
    try:
        assert sched.matched_tokens(req, 0) == 0
        sched.after_alloc(req, [1, 2, 3, 4], 0)
        meta = sched.build_meta(output([new_request(req.request_id, [1, 2, 3, 4], 0)],
                                       scheduled={req.request_id: 100}))
    finally:
        sched.close()
    with worker_side(plan, src) as w:
        w.save(meta)
    return [k for t in meta.saves for k in t.keys]


def lookup_and_load(plan, req, dst) -> tuple[int, set[int]]:
    """``req``'s store hit and, where it has one, the blocks whose load failed (into vLLM
    blocks 5, 6, 7 of ``dst``)."""
    sched = SchedulerSide(plan)
    try:
        hit = sched.matched_tokens(req, 0)
        if not hit:
            return 0, set()
        sched.after_alloc(req, [5, 6, 7, 8], hit)
        meta = sched.build_meta(output([new_request(req.request_id, [5, 6, 7, 8], 0)],
                                       scheduled={req.request_id: 100 - hit}))
    finally:
        sched.close()
    with worker_side(plan, dst) as w:
        return hit, load(w, meta)


@pytest.mark.parametrize("path", ["staged", "in_place"])
def test_salted_requests_of_two_tenants_never_read_each_others_blocks(path):
    plan = with_keys(plan_for(path))
    hashes = block_hashes(f"salt-{uuid.uuid4()}", 3)  # identical for every tenant here
    src = caches(seed=11)
    keys = save_request(plan, salted("a", hashes, "alice"), src)
    assert all(k.startswith("kvmt-s.") and "alice" not in k for k in keys)
    for salt, hit in (("bob", 0), (None, 0), ("", 0), ("alice", 96)):
        dst = caches(seed=12, zero=True)
        assert lookup_and_load(plan, salted(f"r-{salt}", hashes, salt), dst) == (hit, set())
        got = [block_bytes(dst, b) for b in (5, 6, 7)]
        if hit:
            assert got == [block_bytes(src, b) for b in (1, 2, 3)]
        else:
            assert got == [bytes(len(got[0]))] * 3, salt  # nothing landed


def test_the_connectors_tenant_keeps_engines_apart_and_no_tenant_keeps_vllms_keys(monkeypatch):
    hashes = block_hashes(f"engine-{uuid.uuid4()}", 3)
    src = caches(seed=13)
    monkeypatch.setenv("KVMOVE_TENANT", "team-a")
    team_a = with_keys(plan_for())
    assert team_a.keys.tenant == "team-a"
    keys = save_request(team_a, salted("a", hashes, None), src)
    assert keys == [f"kvmt-t.team-a/{h.hex()}" for h in hashes]
    monkeypatch.delenv("KVMOVE_TENANT")
    for plan, hit in ((with_keys(plan_for(), tenant="team-b"), 0), (with_keys(plan_for()), 0),
                      (with_keys(plan_for(), tenant="team-a"), 96)):
        dst = caches(seed=14, zero=True)
        assert lookup_and_load(plan, salted("b", hashes, None), dst)[0] == hit
        if hit:
            assert [block_bytes(dst, b) for b in (5, 6, 7)] == \
                [block_bytes(src, b) for b in (1, 2, 3)]
    # No tenant (or salts not used): the hash hex alone, as vLLM's MooncakeStoreConnector.
    for plan, salt in ((with_keys(plan_for()), None),
                       (with_keys(plan_for(), tenant_from_salt="false"), "alice")):
        part = plan.keys.tenant_part(salted("c", hashes, salt))
        assert part == ""
        assert plan.keys.keys(RANKS, hashes, part) == \
            [f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in hashes]


@pytest.mark.parametrize("extra", [dict(tenant=7), dict(tenant_from_salt="maybe")])
def test_a_bad_tenant_option_is_refused(extra):
    with pytest.raises(ValueError, match=next(iter(extra))):
        VLLMKeyFormat("tiny").with_tenant(extra)


def test_vllms_own_block_hashes_already_differ_per_cache_salt():
    """What vLLM does itself (checked, not assumed): the salt is hashed into a request's
    first block, and the chain carries it into every later one."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)

    def hashes(salt):
        return Request("r", list(range(3 * BS)), SamplingParams(max_tokens=1), None,
                       cache_salt=salt, block_hasher=hasher).block_hashes

    plain, alice, bob = hashes(None), hashes("alice"), hashes("bob")
    assert len(plain) == 3 and plain == hashes(None)
    assert all(len({p, a, b}) == 3 for p, a, b in zip(plain, alice, bob, strict=True))


def test_one_failed_key_of_a_multi_buffer_request_fails_exactly_its_block():
    """Head-outermost caches (``LHBNC``): a block is several regions, one object. The object
    of one block gone, the load reports that vLLM block alone (in the connector's only KV
    group); every region of the others is byte-exact; the next lookup stops before it."""
    plan = with_keys(plan_for("staged"))
    hashes = block_hashes(f"hybrid-{uuid.uuid4()}", 3)
    src = vllm_layer_caches("LHBNC", LAYERS, NUM_BLOCKS, 2, BS, 64, seed=15)
    with worker_side(plan, src) as w:
        assert len(w.views) == 2 * LAYERS  # one region per head and layer
        w.save(KVMoveConnectorMetadata(saves=[BlockTransfer("s", [h.hex() for h in hashes],
                                                            [1, 2, 3])]))
        w._reap_saves(wait=True)
        w.store.remove([w.key_prefix + hashes[1].hex()])
    dst = vllm_layer_caches("LHBNC", LAYERS, NUM_BLOCKS, 2, BS, 64, seed=16)
    for c in dst:
        c.zero_()
    with worker_side(plan, dst) as w:
        errors = load(w, KVMoveConnectorMetadata(loads=[BlockTransfer(
            "l", [h.hex() for h in hashes], [9, 4, 12])]))
    assert errors == {4}
    assert block_bytes(dst, 9) == block_bytes(src, 1)
    assert block_bytes(dst, 12) == block_bytes(src, 3)
    assert block_bytes(dst, 4) == bytes(len(block_bytes(src, 2)))  # a miss writes nothing
    sched = SchedulerSide(plan)
    try:
        assert sched.matched_tokens(salted("n", hashes, None), 0) == BS  # block 0 only
    finally:
        sched.close()


def test_a_failed_load_reports_every_block_the_key_touches_once_per_request():
    """Two requests of one step load the same key into blocks of their own (vLLM's prefix
    cache off): the failed key fails both blocks."""
    plan = with_keys(plan_for("staged"))
    missing = block_hashes(f"never-{uuid.uuid4()}", 1)[0].hex()
    dst = caches(seed=17, zero=True)
    with worker_side(plan, dst) as w:
        errors = load(w, KVMoveConnectorMetadata(loads=[
            BlockTransfer("x", [missing], [2]), BlockTransfer("y", [missing], [3])]))
    assert errors == {2, 3}
    assert block_bytes(dst, 2) == block_bytes(dst, 3) == bytes(len(block_bytes(dst, 2)))
