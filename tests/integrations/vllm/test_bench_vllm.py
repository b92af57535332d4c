"""bench/bench_vllm.py runs end to end on a small geometry (in a process of its own: it starts
its own master) and writes a JSON whose figures are well formed and which the report renders.
The bench checks the loaded bytes itself, every repeat; the figures are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parents[3]


def test_bench_vllm_small(tmp_path):
    out = tmp_path / "bench_vllm.json"
    subprocess.run(
        [sys.executable, "-m", "bench.bench_vllm", "--blocks", "1", "8", "--layers", "2",
         "--heads", "2", "--repeat", "2", "--max-repeat", "3", "--case-seconds", "0",
         "--warmup", "0", "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert [c["blocks"] for c in result["vllm_cases"]] == [1, 8]
    for case in result["vllm_cases"]:  # each save and load judged against >= 1.0x vLLM's
        assert case["repeats"] == 2
        for op in ("save", "load"):
            goal = case["goal"][op]
            assert goal["goal"] == 1.0 and goal["q1"] <= goal["median"] <= goal["q3"]
            assert goal["verdict"] in ("met", "missed", "within noise")
    v = result["vllm"]  # the largest case
    assert v["blocks"] == 8 and v["object_bytes"] == 2 * 2 * 16 * 2 * 64 * 2
    assert set(v["median_s"]) == {
        "kvmove save", "kvmove save (exists query)", "vLLM save", "vLLM save (inline)",
        "kvmove save returns", "vLLM save returns", "kvmove load", "kvmove load (in the step)",
        "kvmove load (layer-wise)", "vLLM load", "vLLM load (inline)", "kvmove load returns",
        "vLLM load returns"}
    assert all(s > 0 for s in v["median_s"].values())
    for ratio in ("save_ratio", "load_ratio", "load_ratio_in_step", "save_ratio_exists_query"):
        assert v[ratio] > 0
    assert v["kvmove_path"]["save"] in ("staged", "in_place")
    md = "\n".join(report.suite_section("vllm", result))
    assert "| kvmove save returns |" in md and "kvmove's save with the exists query" in md
    assert "| kvmove load returns |" in md and "kvmove's load inside the step" in md
