"""End to end with real vLLM engines on a tiny seeded Llama, six engine starts, each check on
the runs it needs:

1. no connector: the reference outputs;
2. A, kvmove's connector: computes and saves p1 and the fault groups;
3. B, a fresh kvmove engine (empty prefix cache) with synchronous loads: loads p1, layer by
   layer;
4. V, vLLM's own MooncakeStoreConnector: loads p1 (kvmove's objects), computes and saves p2;
5. D, kvmove's connector as configured by default (asynchronous loads), faults injected:
   loads p1 while its requests wait, then a group with a missing last object and one whose
   first object cannot be loaded (vLLM recomputes them: the outputs of the run without a
   connector; the request whose first block failed is looked up again and not loaded
   again);
6. C, kvmove's connector with faults injected, loading whole-cache in the step: p2 (vLLM's
   objects), then zeros in place of the stored blocks (the outputs change), a missing object
   and a killed master (vLLM recomputes: the outputs of the run without a connector).

A fresh engine that reports ``num_cached_tokens`` > 0 on prompts it has never seen got them
from the store. A run that dies keeps the phases it finished; later runs start regardless.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.conftest import BLOCK, KVMOVE, VLLM_MOONCAKE

pytestmark = pytest.mark.engine

PROMPT_TOKENS = 100
LOADED = PROMPT_TOKENS // BLOCK * BLOCK  # full blocks are stored and loaded

FAULTY_ASYNC = {**KVMOVE, "kv_role": "kv_consumer", "kv_connector": "FaultyKVMoveConnector",
                "kv_connector_module_path": "tests.integrations.vllm.fault_connector"}
FAULTY = {**FAULTY_ASYNC,
          "kv_connector_extra_config": {"load_async": "false", "layerwise": "false"}}
SYNC_LAYERWISE = {**KVMOVE, "kv_connector_extra_config": {"load_async": "false"}}


# float32 engines: run to run, logprobs move by ~1e-6 (reduction order); zeros in place of
# the stored blocks moved them by more than 1.
LOGPROB_TOLERANCE = 1e-4


def same(a: list[dict], b: list[dict]) -> bool:
    """The same token ids, and logprobs within ``LOGPROB_TOLERANCE``."""
    return ([r["token_ids"] for r in a] == [r["token_ids"] for r in b]
            and all(abs(x - y) <= LOGPROB_TOLERANCE
                    for r, s in zip(a, b, strict=True)
                    for x, y in zip(r["logprobs"], s["logprobs"], strict=True)))


def cached(results: list[dict]) -> list[int]:
    return [r["num_cached_tokens"] for r in results]


@pytest.fixture(scope="module")
def baseline(engines, prompts):
    return engines.run(None, [{"name": n, "prompts": p} for n, p in prompts.items()])


@pytest.fixture(scope="module")
def writer(engines, prompts):
    return engines.run(KVMOVE, [{"name": n, "prompts": p} for n, p in prompts.items()
                                if n != "p2"])


@pytest.fixture(scope="module")
def reader(engines, prompts, writer):
    return engines.run(SYNC_LAYERWISE, [{"name": "p1", "prompts": prompts["p1"]}])


@pytest.fixture(scope="module")
def vllm_engine(engines, prompts, writer):
    return engines.run(VLLM_MOONCAKE, [{"name": "p1", "prompts": prompts["p1"]},
                                       {"name": "p2", "prompts": prompts["p2"]}])


@pytest.fixture(scope="module")
def async_loads(engines, prompts, writer):
    start = len(engines.events_log())
    run = engines.run(FAULTY_ASYNC, [
        {"name": "p1", "prompts": prompts["p1"], "faults": "none"},
        {"name": "async_remove", "prompts": prompts["async_remove"], "faults": "remove"},
        {"name": "async_wrong_size", "prompts": prompts["async_wrong_size"],
         "faults": "wrong_size"}])
    run.events = engines.events_log()[start:]
    return run


@pytest.fixture(scope="module")
def faulty(engines, prompts, writer, vllm_engine, async_loads):
    # after async_loads: this run kills the master
    start = len(engines.events_log())
    phases = [{"name": "p2", "prompts": prompts["p2"], "faults": "none"}]
    phases += [{"name": n, "prompts": prompts[n], "faults": n}
               for n in ("zeros", "remove", "kill")]  # kill last: the master is gone after
    run = engines.run(FAULTY, phases)
    run.events = engines.events_log()[start:]
    return run


def test_outputs_depend_on_the_kv_cache(baseline):
    # Random weights: distinct prompts give distinct outputs, far from uniform logits.
    outs = [tuple(r["token_ids"]) for g in baseline.results.values() for r in g]
    assert len(outs) == 14 and len(set(outs)) == len(outs), baseline.error
    assert max(lp for g in baseline.results.values() for r in g for lp in r["logprobs"]) > -5


def test_writer_outputs_equal_no_connector(baseline, writer):
    for name in ("p1", "zeros", "remove", "kill", "async_remove", "async_wrong_size"):
        assert cached(writer[name]) == [0, 0], name
        assert same(writer[name], baseline[name]), name
    assert writer.error is None


def test_fresh_engine_loads_kvmove_objects(baseline, writer, reader):
    assert cached(reader["p1"]) == [LOADED, LOADED]
    assert same(reader["p1"], baseline["p1"])
    assert reader.error is None


def test_asynchronous_loads_land_while_the_requests_wait(baseline, async_loads):
    assert cached(async_loads["p1"]) == [LOADED, LOADED]
    assert same(async_loads["p1"], baseline["p1"])
    none = [e for e in async_loads.events if e["mode"] == "none"]
    assert sum(e.get("finished_recving", 0) for e in none) == 2, async_loads.events
    assert not any(e.get("load_errors") for e in none)


def test_a_failed_asynchronous_load_is_recomputed(baseline, async_loads):
    """The last block of each request's load is missing: reported with the request's
    finished load, and vLLM recomputes from it."""
    removed = [e for e in async_loads.events if e["mode"] == "remove"]
    assert sum(e.get("load_errors", 0) for e in removed) >= 2, async_loads.events
    assert sum(e.get("finished_recving", 0) for e in removed) == 2
    assert same(async_loads["async_remove"], baseline["async_remove"])
    assert async_loads.error is None


def test_a_load_failed_at_its_first_block_is_not_tried_again(baseline, async_loads):
    """The first block's object of each request is found but cannot be loaded: vLLM frees
    the request's blocks and looks it up again; that lookup stops before the failed block,
    so each request is loaded once (3 blocks) and computed, not loaded again and again."""
    events = [e for e in async_loads.events if e["mode"] == "wrong_size"]
    assert sum(e.get("blocks", 0) for e in events) == 6, events
    assert sum(e.get("load_errors", 0) for e in events) >= 2
    assert cached(async_loads["async_wrong_size"]) == [0, 0]
    assert same(async_loads["async_wrong_size"], baseline["async_wrong_size"])


def test_vllm_connector_reads_kvmove_objects(baseline, writer, vllm_engine):
    assert cached(vllm_engine["p1"]) == [LOADED, LOADED]
    assert same(vllm_engine["p1"], baseline["p1"])


def test_vllm_connector_computes_and_saves(baseline, vllm_engine):
    assert cached(vllm_engine["p2"]) == [0, 0]
    assert same(vllm_engine["p2"], baseline["p2"])
    assert vllm_engine.error is None


def test_kvmove_reads_vllm_connector_objects(baseline, vllm_engine, faulty):
    assert cached(faulty["p2"]) == [LOADED, LOADED]
    assert same(faulty["p2"], baseline["p2"])
    assert not any(e.get("load_errors") for e in faulty.events if e["mode"] == "none")


def test_zeros_in_place_of_the_stored_blocks_change_outputs(baseline, faulty):
    assert cached(faulty["zeros"]) == [LOADED, LOADED]
    assert [r["token_ids"] for r in faulty["zeros"]] != \
        [r["token_ids"] for r in baseline["zeros"]]
    assert not any(e.get("load_errors") for e in faulty.events if e["mode"] == "zeros")


@pytest.mark.parametrize("mode", ["remove", "kill"])
def test_failed_loads_are_recomputed(baseline, faulty, mode):
    """A missing object, a killed master: load errors, which vLLM recomputes."""
    errors = sum(e.get("load_errors", 0) for e in faulty.events if e["mode"] == mode)
    assert errors >= 2, (mode, faulty.events)
    assert same(faulty[mode], baseline[mode])
    if mode == "kill":
        assert faulty.error is None
