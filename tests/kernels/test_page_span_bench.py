"""The GPU benchmark's page-span cases (``bench/bench_gpu.py``) run end to end on the CPU
(tiny cases, the kernel through the Triton interpreter): every mode's bytes are checked
inside, and the record renders as the table the GPU check reports, so that the first GPU
run does not die on a typo."""

from __future__ import annotations

import pytest
import torch

from bench import bench_gpu

pytestmark = [pytest.mark.usefixtures("triton_interpreter"), pytest.mark.interpreter]


def test_page_span_cases_run_on_the_cpu():
    args = bench_gpu.settle(bench_gpu.build_parser().parse_args(
        ["--layers", "2", "--span-row-bytes", "132", "--span-page-tokens", "4",
         "--target-mib", "0.01", "--repeats", "2", "--warmup", "0"]))
    records = bench_gpu.measure_page_spans(args, torch.device("cpu"))
    assert [(r["direction"], r["row_bytes"], r["page_tokens"]) for r in records] == [
        ("gather", 132, 4), ("scatter", 132, 4)]
    for r in records:
        for mode in (*bench_gpu.SPAN_MODES, "bulk"):
            assert r[f"{mode}_gbps"] > 0 and r[f"{mode}_spread"] >= 0
        assert r["spans_vs_rows"] == pytest.approx(r["spans_gbps"] / r["rows_gbps"])
    md = "\n".join(bench_gpu.markdown({"layers": 2, "repeats": 2, "page_spans": records}))
    assert "| gather | 132 | 4 | " in md and "spans/rows" in md
