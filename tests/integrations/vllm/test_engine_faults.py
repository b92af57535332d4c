"""A store node killed while a vLLM engine serves: a cluster of a master and two store-only
processes holding every object (engines contribute no memory), ``KVMOVE_REPLICAS=2``.

1. W, kvmove's connector: computes and saves two groups of prompts (its outputs are the
   no-connector outputs: ``test_engine.py`` shows a computing engine's are);
2. R, a fresh engine with kvmove's connector (faults injected, whole-cache loads): the first
   store node is SIGKILLed just before its first load: every block loads from the surviving
   replica, in the same load (``num_cached_tokens`` is the stored prefix, no load error) and
   the outputs are W's; then the second node is killed too: the blocks are lost, loads fail
   or find nothing, and vLLM recomputes (the outputs are still W's).
"""

from __future__ import annotations

import types

import pytest

import kvmove
from tests.integrations.vllm.conftest import KVMOVE, Engines
from tests.integrations.vllm.test_engine import FAULTY, LOADED, cached, same
from tests.support.holder import Holder

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("cluster")
    with kvmove.EmbeddedMaster() as master:
        holders = [Holder(master.address, log_path=work / f"holder{i}.log") for i in range(2)]
        try:
            yield master, holders, work
        finally:
            for h in holders:
                h.close()


@pytest.fixture(scope="module")
def cluster_engines(cluster, model_dir) -> Engines:
    master, holders, work = cluster
    engines = Engines(types.SimpleNamespace(address=master.address, master=master),
                      model_dir, work)
    engines.env = {"KVMOVE_REPLICAS": "2", "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
                   "KVMOVE_TEST_HOLDER_PIDS": ",".join(str(h.pid) for h in holders)}
    return engines


@pytest.fixture(scope="module")
def saved(cluster_engines, prompts):
    return cluster_engines.run(KVMOVE, [{"name": n, "prompts": prompts[n]}
                                        for n in ("p1", "p2")])


@pytest.fixture(scope="module")
def served(cluster_engines, prompts, saved):
    run = cluster_engines.run(FAULTY, [
        {"name": "p1", "prompts": prompts["p1"], "faults": "kill_holder:0"},
        {"name": "p2", "prompts": prompts["p2"], "faults": "kill_holder:1"}])
    run.events = cluster_engines.events_log()
    return run


def test_the_writer_computes_and_saves(saved):
    assert saved.error is None
    assert cached(saved["p1"]) == [0, 0] and cached(saved["p2"]) == [0, 0]


def test_a_killed_store_node_loses_nothing_with_a_second_replica(saved, served, cluster):
    _, holders, _ = cluster
    assert not holders[0].alive()
    assert cached(served["p1"]) == [LOADED, LOADED]
    assert same(served["p1"], saved["p1"])
    errors = [e for e in served.events if e["mode"] == "kill_holder:0" and "load_errors" in e]
    assert errors == [], errors


def test_both_store_nodes_killed_blocks_are_recomputed(saved, served, cluster):
    _, holders, _ = cluster
    assert not holders[1].alive()
    assert same(served["p2"], saved["p2"])  # recomputed: the same answers
    errors = sum(e.get("load_errors", 0) for e in served.events
                 if e["mode"] == "kill_holder:1")
    assert errors > 0 or cached(served["p2"]) == [0, 0], served.events
    assert served.error is None
