"""The metrics-cost benchmark runs end to end and reports every call, off against on, with
its spread (no timing is asserted)."""

from __future__ import annotations

import json


def test_the_metrics_cost_benchmark_reports_off_on_and_spread(tmp_path, capsys):
    from bench import bench_metrics_cost
    from kvmove import metrics

    out = tmp_path / "cost.json"
    assert bench_metrics_cost.main(["--device", "cpu", "--layers", "2", "--page-tokens", "4",
                                    "--pages", "2", "--rounds", "2", "--calls", "3",
                                    "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["op"] for r in result["rows"]] == list(bench_metrics_cost.OPS)
    for r in result["rows"]:
        assert r["off_us"] > 0 and r["on_us"] > 0 and r["goal_us"] == 2.0
        assert r["added_min_us"] <= r["added_us"] <= r["added_max_us"]
    assert result["command"].startswith("python -m bench.bench_metrics_cost --device cpu")
    assert "metrics off vs on" in capsys.readouterr().out
    assert not metrics.enabled()  # the bench leaves metrics as it found them: off
