"""bench/bench_sglang.py runs end to end on a small geometry (in a process of its own: it
starts its own master and sets the MOONCAKE_* variables) and writes a JSON whose figures
are well formed. The figures themselves are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
VERDICTS = ("met", "missed", "within noise")


def test_bench_sglang_small(tmp_path):
    out = tmp_path / "bench_sglang.json"
    subprocess.run(
        [sys.executable, "-m", "bench.bench_sglang", "--pages", "8", "64", "--layers", "3",
         "--repeat", "2", "--e2e-cases", "1x1", "4x4", "--e2e-repeat", "3", "--e2e-seconds", "0",
         "--holder-bytes", str(256 << 20), "--json", str(out)],
        cwd=ROOT, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["sglang"] == "0.5.23"
    assert [(d["layout"], d["pages"]) for d in result["describe"]] == [
        ("layer_first", 8), ("page_first", 8), ("layer_first", 64), ("page_first", 64)]
    assert [d["spans_per_key"] for d in result["describe"]] == [3, 1, 3, 1]
    for d in result["describe"]:  # each judged against >= 1.0x, layer_first also >= 5x
        assert d["goal"]["goal"] == 1.0 and d["goal"]["verdict"] in VERDICTS
        assert (d["loop_target"] or {}).get("goal") == (5.0 if d["spans_per_key"] > 1 else None)
    assert [(e["layout"], e["pages"], e["page_size"]) for e in result["end_to_end"]] == [
        ("layer_first", 1, 1), ("page_first", 1, 1), ("layer_first", 4, 4),
        ("page_first", 4, 4)]
    for e in result["end_to_end"]:
        assert "failed" not in e, e
        assert e["speedup_set"] > 0 and e["speedup_get"] > 0
        assert e["bytes"] == e["pages"] * e["page_size"] * 3 * 576 * 2
        assert e["repeats"] == 3  # the fewest a case gets, however slow
        for op in ("set", "get"):
            goal = e["goal"][op]
            assert goal["q1"] <= goal["median"] <= goal["q3"] and goal["verdict"] in VERDICTS
            assert e["spread"][f"kvmove {op}"] >= 0 and e["spread"][f"sglang {op}"] >= 0
