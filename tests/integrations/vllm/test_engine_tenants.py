"""Tenants end to end, with real vLLM engines on the tiny seeded Llama (two engine starts,
each a fresh process with an empty prefix cache, one Mooncake master):

1. kvmove's connector computes and saves the same prompts with ``cache_salt`` "alice", then
   "bob": bob's requests find none of alice's blocks in the store;
2. a fresh engine: the prompts with no salt find nothing; alice's load her blocks (the
   outputs of her computed run).

A connector that names its own ``tenant`` is checked on the connector's scheduler side, without
an engine start of its own (``test_tenant_keys.py``).

``num_cached_tokens`` > 0 in a fresh engine means the blocks came from the store.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.conftest import BLOCK, KVMOVE
from tests.integrations.vllm.test_engine import PROMPT_TOKENS, cached, same

pytestmark = pytest.mark.engine

LOADED = PROMPT_TOKENS // BLOCK * BLOCK
SYNC = {**KVMOVE, "kv_connector_extra_config": {"load_async": "false"}}


def salted(prompts: list[list[int]], salt: str | None) -> list:
    return [p if salt is None else {"prompt_token_ids": p, "cache_salt": salt} for p in prompts]


@pytest.fixture(scope="module")
def runs(engines, prompts):
    p = prompts["p1"]
    first = engines.run(SYNC, [{"name": "alice", "prompts": salted(p, "alice")},
                               {"name": "bob", "prompts": salted(p, "bob")}])
    second = engines.run(SYNC, [{"name": "none", "prompts": salted(p, None)},
                                {"name": "alice", "prompts": salted(p, "alice")}])
    return first, second


def test_a_salt_never_reads_another_salts_blocks(runs):
    first, _ = runs
    assert cached(first["alice"]) == [0, 0] and cached(first["bob"]) == [0, 0]
    assert same(first["alice"], first["bob"])  # the same tokens: the same outputs
    assert first.error is None


def test_no_salt_finds_nothing_and_the_same_salt_loads_its_blocks(runs):
    first, second = runs
    assert cached(second["none"]) == [0, 0]
    assert cached(second["alice"]) == [LOADED, LOADED]
    assert same(second["alice"], first["alice"])
    assert second.error is None
