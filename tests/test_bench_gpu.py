"""The GPU benchmark (``bench/bench_gpu.py``) before it meets a GPU: its arguments, its
verdicts and reports from a results record, the tuner table it writes, a clean
``skipped`` without a GPU, and its copy measurements themselves run on the CPU (tiny
cases, the Triton interpreter for the kernel), so that the first GPU run does not die on
a typo. The matmul interference needs CUDA streams and runs only there."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from bench import bench_gpu, report
from kvmove.kernels.configs import TunedTable


def args_of(*argv):
    return bench_gpu.settle(bench_gpu.build_parser().parse_args(list(argv)))


def test_arguments_and_quick():
    a = args_of("--quick")
    assert a.repeats == 5 and a.warmup == 1 and a.target_mib == 128
    assert a.row_bytes == [656, 132, 1152] and a.caps == [4, 8, 16]
    assert a.ce_pages == [16, 256]
    with pytest.raises(SystemExit, match="include 8"):
        args_of("--caps", "4", "16")
    with pytest.raises(SystemExit, match="--layers must be positive"):
        args_of("--layers", "0")
    with pytest.raises(SystemExit, match="--row-bytes"):
        args_of("--row-bytes", "656", "-1")


def test_without_a_gpu_it_records_skipped(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--device", "cpu", "--json", str(out),
                           "--paths-out", str(tmp_path / "paths.json")]) == 0
    result = json.loads(out.read_text())
    assert "needs a CUDA GPU" in result["skipped"]
    assert result["command"].startswith("python -m bench.bench_gpu --device cpu")
    assert not (tmp_path / "paths.json").exists()
    assert "skipped" in capsys.readouterr().out
    assert "needs a CUDA GPU" in "\n".join(report.suite_section("gpu", result))


def fake_result() -> dict:
    def copy(direction, rb, ratio, programs=16, **extra):
        return {"direction": direction, "row_bytes": rb, "page_tokens": 64, "pages": 100,
                "layers": 61, "bytes": 1 << 20, "max_programs": programs,
                "kvmove_gbps": 50.0 * ratio, "ratio": ratio, **extra}

    return {
        "benchmark": "bench_gpu", "gpu": "NVIDIA H200", "layers": 61, "repeats": 5,
        "command": "python -m bench.bench_gpu --quick",
        "vs_bulk": [copy("gather", 656, 0.95, bulk_gbps=50.0),
                    copy("gather", 132, 0.88, bulk_gbps=50.0, kernel_gbps=47.5),
                    copy("scatter", 656, 0.9, bulk_gbps=50.0)],
        "vs_per_page": [copy("gather", 656, 14.0, per_page_gbps=3.4),
                        copy("scatter", 132, 31.0, per_page_gbps=1.2)],
        "matmul": {"matmul": 8192, "matmul_tflops": 780.0, "row_bytes": 656,
                   "caps": {"4": {"slowdown": 0.01, "gather_gbps_beside": 20.0},
                            "8": {"slowdown": 0.04, "gather_gbps_beside": 35.0},
                            "16": {"slowdown": 0.09, "gather_gbps_beside": 48.0}}},
        "copy_engine": [
            {"direction": "gather", "row_bytes": 656, "page_tokens": 16, "pages": 16,
             "bytes": 100, "direct_gbps": 9.0, "two_hop_gbps": 3.0, "faster": "direct"},
            {"direction": "gather", "row_bytes": 656, "page_tokens": 16, "pages": 4096,
             "bytes": 10_000, "direct_gbps": 40.0, "two_hop_gbps": 52.0, "faster": "two_hop"},
            {"direction": "scatter", "row_bytes": 132, "page_tokens": 1, "pages": 256,
             "bytes": 500, "direct_gbps": 20.0, "two_hop_gbps": 5.0, "faster": "direct"},
        ],
        "refused_batches": 0,
    }


def test_goals_are_judged_on_the_worst_case():
    goals = {g.name: g for g in bench_gpu.goals(fake_result())}
    assert goals["gather_vs_bulk"].value == pytest.approx(0.88)
    assert goals["gather_vs_bulk"].met is False  # 132-byte rows miss 0.9
    assert goals["scatter_vs_bulk"].met is True
    assert goals["vs_per_page"].value == pytest.approx(14.0) and goals["vs_per_page"].met
    assert goals["matmul_slowdown_at_8"].value == pytest.approx(0.04)
    assert goals["matmul_slowdown_at_8"].met is True
    over = fake_result()
    over["vs_bulk"][0]["max_programs"] = 32  # a tuned table that takes more SMs
    capped = {g.name: g for g in bench_gpu.goals(over)}["gather_vs_bulk"]
    assert capped.met is None and "exceeds the cap" in capped.text
    assert {g.name: g.met for g in bench_gpu.goals({})} == dict.fromkeys(bench_gpu.GOALS)


def test_tuner_paths_follow_the_bytes_each_path_won(tmp_path):
    result = fake_result()
    paths = bench_gpu.tuner_paths(result["copy_engine"])
    assert paths == {"gather/small/p16": "two_hop", "scatter/tiny/p1": "direct"}
    result["tuner_paths"] = paths
    out = tmp_path / "paths.json"
    bench_gpu.write_paths(result, out)
    table = TunedTable.from_json(json.loads(out.read_text()))
    assert table.paths == paths and table.configs == {}


def test_markdown_and_report_come_from_the_record():
    result = fake_result()
    md = "\n".join(bench_gpu.markdown(result))
    assert "gather vs a bulk pinned copy (worst row size, <= 16 programs): 0.88x" in md
    assert "MISSED" in md and "met" in md
    assert "| gather | 132 | 64 | 44.0 | 47.5 | 50.0 | 0.88x | 16 |" in md
    assert "| gather | 656 | 64 | 47.5 | - | 50.0 | 0.95x | 16 |" in md  # no kernel figure
    assert "| 8 | +4.0% | 35.0 |" in md
    assert "| gather | 656 | 16 | 4096 | 40.0 | 52.0 | two_hop |" in md
    assert md == "\n".join(report.suite_section("gpu", result))
    console = Console(record=True, width=200)
    bench_gpu.report(result, console)
    text = console.export_text()
    assert "MISSED" in text and "| scatter | 132 | 64 |" in text


def test_the_copy_measurements_run_on_the_cpu(monkeypatch):
    """measure_copies and measure_copy_engine end to end on tiny CPU cases, every copy's
    bytes checked inside them (the two-hop path through its host ring against the torch
    backend). The direct copies take the torch backend here: the kernel itself is tested
    elsewhere, through the interpreter, and on the GPU."""
    monkeypatch.setattr(bench_gpu, "DIRECT", "torch")
    args = args_of("--layers", "2", "--row-bytes", "132", "--page-tokens", "4",
                   "--per-page-tokens", "1", "4", "--target-mib", "0.05", "--ce-pages", "3",
                   "40", "--ce-page-tokens", "16", "--repeats", "2", "--warmup", "0",
                   "--max-calls", "50")
    cpu = torch.device("cpu")
    bulk, per_page = bench_gpu.measure_copies(args, cpu)
    assert [(r["direction"], r["page_tokens"]) for r in bulk] == [("gather", 4), ("scatter", 4)]
    assert {(r["direction"], r["page_tokens"]) for r in per_page} == {
        (d, pt) for d in ("gather", "scatter") for pt in (1, 4)}
    for r in bulk + per_page:
        assert r["ratio"] > 0 and r["kvmove_gbps"] > 0
    assert all(r["per_page_calls"] <= 50 for r in per_page)
    ce = bench_gpu.measure_copy_engine(args, cpu)
    assert len(ce) == 2 * 2 and {r["faster"] for r in ce} <= {"direct", "two_hop"}
    assert sorted({r["pages"] for r in ce}) == [3, 12]  # 40 pages: over 0.05 MiB
    result = SimpleNamespace(**{"copy_engine": ce})
    assert set(bench_gpu.tuner_paths(result.copy_engine)) == {"gather/tiny/p16",
                                                              "scatter/tiny/p16"}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_kernel" name="test_a"/>
<testcase classname="tests.gpu.test_mover" name="test_b">{extra}</testcase>
</testsuite></testsuites>"""


def test_the_verdict_fails_on_a_skip_a_refused_batch_or_a_failed_step(tmp_path):
    from bench import gpu_verdict

    def run(extra="", bench=None, *argv):
        junit = tmp_path / "t.xml"
        junit.write_text(JUNIT.format(extra=extra))
        path = tmp_path / "b.json"
        path.write_text(json.dumps(bench if bench is not None else
                                   {**fake_result(), "goals": {
                                       g.name: {"value": g.value, "met": g.met}
                                       for g in bench_gpu.goals(fake_result())}}))
        return gpu_verdict.verdict(gpu_verdict.read_junit(junit), json.loads(path.read_text()),
                                   list(argv), deselected=1, seconds=300)

    ok, line = run()
    assert ok and line.startswith("GPU CHECK: PASS - 2/2 GPU tests passed")
    assert "1 multi-GPU test(s) not run" in line and "goals met 3/4" in line
    assert "missed: gather_vs_bulk 0.88" in line and "0 refused batches" in line
    ok, line = run('<skipped message="needs Mooncake"/>')
    assert not ok and "1 GPU test(s) skipped (first: tests.gpu.test_mover::test_b)" in line
    ok, line = run('<failure message="boom"/>')
    assert not ok and "1 GPU test(s) failed" in line
    ok, line = run("", {**fake_result(), "refused_batches": 2})
    assert not ok and "2 copy-engine batch(es) refused" in line
    ok, line = run("", None, "tuning")
    assert not ok and "step(s) failed: tuning" in line
    ok, line = run("", {"skipped": "needs a CUDA GPU"})
    assert not ok and "benchmark skipped" in line
    assert gpu_verdict.read_junit(tmp_path / "missing.xml") is None
    assert gpu_verdict.verdict(None, None, [])[0] is False


def test_the_verdict_names_the_transfer_engine_tests_it_could_not_run(tmp_path):
    from bench import gpu_verdict

    junit = tmp_path / "t.xml"
    junit.write_text(JUNIT.format(extra=""))
    bench = {**fake_result(), "goals": {}}
    ok, line = gpu_verdict.verdict(gpu_verdict.read_junit(junit), bench, [], no_mooncake=3)
    assert ok and "3 Transfer Engine test(s) not run (no Mooncake here" in line
    ok, line = gpu_verdict.verdict(gpu_verdict.read_junit(junit), bench, [])
    assert ok and "Transfer Engine" not in line
    assert gpu_verdict.main(["--junit", str(junit), "--bench", str(tmp_path / "none.json"),
                             "--no-mooncake", "2"]) == 1  # no benchmark: a failure
