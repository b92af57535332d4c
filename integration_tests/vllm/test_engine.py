"""End to end with real vLLM engines on a tiny seeded Llama: kvmove's connector writes and a
fresh engine loads; vLLM's own MooncakeStoreConnector and kvmove's read each other's objects;
a connector that loads zeros changes the outputs; a missing object and a killed master leave
vLLM recomputing with correct outputs. Five engine starts in all (about 45 s each here)."""

from __future__ import annotations

import pytest

from integration_tests.vllm.conftest import BLOCK, KVMOVE, VLLM_MOONCAKE

pytestmark = pytest.mark.engine

FULL_BLOCKS = 100 // BLOCK  # prompts are 100 tokens: 3 full blocks are stored and loaded


def same(a: list[dict], b: list[dict]) -> bool:
    return ([r["token_ids"] for r in a] == [r["token_ids"] for r in b]
            and [r["logprobs"] for r in a] == [r["logprobs"] for r in b])


@pytest.fixture(scope="module")
def baseline(engines, prompts):
    """No connector: the reference outputs of every prompt group."""
    return engines.run(None, [{"name": n, "prompts": p} for n, p in prompts.items()])


@pytest.fixture(scope="module")
def kvmove_writer(engines, prompts):
    """Engine A: kvmove's connector computes every group but p2 and saves its blocks."""
    return engines.run(KVMOVE, [{"name": n, "prompts": p} for n, p in prompts.items()
                                if n != "p2"])


@pytest.fixture(scope="module")
def vllm_engine(engines, prompts, kvmove_writer):
    """vLLM's MooncakeStoreConnector: reads p1 (written by kvmove), then computes p2 and
    saves it (read by kvmove below)."""
    return engines.run(VLLM_MOONCAKE, [{"name": "p1", "prompts": prompts["p1"]},
                                       {"name": "p2", "prompts": prompts["p2"]}])


@pytest.fixture(scope="module")
def kvmove_reader(engines, prompts, vllm_engine):
    """Engine B, fresh: loads p1 (its own objects) and p2 (vLLM's), layer by layer."""
    return engines.run(KVMOVE, [{"name": "p1", "prompts": prompts["p1"]},
                                {"name": "p2", "prompts": prompts["p2"]}])


def test_outputs_depend_on_the_kv_cache(baseline):
    # Random weights: distinct prompts give distinct outputs, far from uniform logits.
    outs = [tuple(r["token_ids"]) for g in baseline.values() for r in g]
    assert len(set(outs)) == len(outs)
    assert max(lp for g in baseline.values() for r in g for lp in r["logprobs"]) > -5.0


def test_writer_outputs_equal_no_connector(baseline, kvmove_writer):
    for name, results in kvmove_writer.items():
        assert same(results, baseline[name]), name
        assert all(r["num_cached_tokens"] == 0 for r in results)


def test_fresh_engine_loads_kvmove_objects(baseline, kvmove_writer, kvmove_reader):
    loaded = kvmove_reader["p1"]
    assert [r["num_cached_tokens"] for r in loaded] == [FULL_BLOCKS * BLOCK] * len(loaded)
    assert same(loaded, baseline["p1"])
    assert same(loaded, kvmove_writer["p1"])


def test_vllm_connector_reads_kvmove_objects(baseline, vllm_engine):
    loaded = vllm_engine["p1"]
    assert [r["num_cached_tokens"] for r in loaded] == [FULL_BLOCKS * BLOCK] * len(loaded)
    assert same(loaded, baseline["p1"])


def test_kvmove_reads_vllm_connector_objects(baseline, vllm_engine, kvmove_reader):
    assert all(r["num_cached_tokens"] == 0 for r in vllm_engine["p2"])  # computed, saved
    assert same(vllm_engine["p2"], baseline["p2"])
    loaded = kvmove_reader["p2"]
    assert [r["num_cached_tokens"] for r in loaded] == [FULL_BLOCKS * BLOCK] * len(loaded)
    assert same(loaded, baseline["p2"])


def test_faults(engines, prompts, baseline, kvmove_writer, kvmove_reader):
    """One engine, three faults, loading whole-cache: zeros in place of the stored blocks
    change the outputs (the check can fail); a missing object and a killed master are
    load errors that vLLM recomputes, with the outputs of a run without a connector."""
    faulty = {**KVMOVE, "kv_role": "kv_consumer",
              "kv_connector": "FaultyKVMoveConnector",
              "kv_connector_module_path": "integration_tests.vllm.fault_connector",
              "kv_connector_extra_config": {"layerwise": "false"}}
    out = engines.run(faulty, [{"name": n, "prompts": prompts[n], "faults": n}
                               for n in ("zeros", "remove", "kill")])
    events = engines.events_log()
    assert [r["num_cached_tokens"] for r in out["zeros"]] == [FULL_BLOCKS * BLOCK] * 2
    assert not same(out["zeros"], baseline["zeros"])
    assert [r["token_ids"] for r in out["zeros"]] != [r["token_ids"] for r in baseline["zeros"]]
    for mode in ("remove", "kill"):
        errors = sum(e.get("load_errors", 0) for e in events if e["mode"] == mode)
        assert errors >= len(prompts[mode]), (mode, events)
        assert same(out[mode], baseline[mode]), mode
    assert not any(e.get("load_errors") for e in events if e["mode"] == "zeros")
