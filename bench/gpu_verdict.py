"""The one verdict line of ``scripts/gpu_check.sh``, from what its steps left behind: the
GPU tests' JUnit XML, the GPU benchmark's JSON and the steps that failed. A skipped GPU
test, a test that failed, a refused copy-engine batch, a missing binding (the preflight
step) or a step that failed or ran out of time is a failure; missed performance goals are
reported in the line, not failures (they are measurements, judged by a person).

    python -m bench.gpu_verdict --junit OUT/gpu_tests.xml --bench OUT/bench_gpu.json \\
        [--failed-step NAME ...] [--deselected N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TestCounts:
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    skipped_names: list[str] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def read_junit(path: Path) -> TestCounts | None:
    """The counts of a pytest JUnit XML file (None when missing or unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = TestCounts()
    for case in root.iter("testcase"):
        counts.tests += 1
        if case.find("skipped") is not None:
            counts.skipped += 1
            counts.skipped_names.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("failure") is not None:
            counts.failures += 1
        elif case.find("error") is not None:
            counts.errors += 1
    return counts


def verdict(junit: TestCounts | None, bench: dict | None, failed_steps: list[str], *,
            deselected: int = 0, no_mooncake: int = 0,
            seconds: float | None = None) -> tuple[bool, str]:
    """``(passed, line)``. ``deselected``: multi-GPU tests not run on a one-GPU machine;
    ``no_mooncake``: Transfer Engine tests not run because Mooncake is not installed there
    (both are named in the line, neither fails the check)."""
    problems, facts = [], []
    if failed_steps:
        problems.append(f"step(s) failed: {', '.join(failed_steps)}")
    if junit is None:
        problems.append("no GPU test results")
    else:
        facts.append(f"{junit.passed}/{junit.tests} GPU tests passed")
        if junit.failures or junit.errors:
            problems.append(f"{junit.failures} GPU test(s) failed, {junit.errors} error(s)")
        if junit.skipped:
            problems.append(f"{junit.skipped} GPU test(s) skipped (first: "
                            f"{junit.skipped_names[0]})")
        if junit.tests == 0:
            problems.append("no GPU test ran")
    if deselected:
        facts.append(f"{deselected} multi-GPU test(s) not run (one GPU)")
    if no_mooncake:
        facts.append(f"{no_mooncake} Transfer Engine test(s) not run (no Mooncake here: "
                     "carry it with WITH_MOONCAKE=1 scripts/gpu_payload.sh)")
    if bench is None:
        problems.append("no GPU benchmark results")
    elif "skipped" in bench:
        problems.append(f"GPU benchmark skipped: {bench['skipped']}")
    else:
        refused = bench.get("refused_batches", 0)
        if refused:
            problems.append(f"{refused} copy-engine batch(es) refused")
        goals = bench.get("goals", {})
        met = [n for n, g in goals.items() if g.get("met")]
        missed = [f"{n} {g['value']:.3g}" for n, g in goals.items()
                  if g.get("met") is False]
        facts.append(f"benchmark goals met {len(met)}/{len(goals)}"
                     + (f" (missed: {', '.join(missed)})" if missed else ""))
        facts.append(f"{refused} refused batches")
        spans = sorted(r["spans_vs_rows"] for r in bench.get("page_spans", []))
        if spans:
            facts.append(f"page spans vs row mode {spans[0]:.2f}-{spans[-1]:.2f}x "
                         f"(median {spans[len(spans) // 2]:.2f}x, {len(spans)} cases)")
    if seconds is not None:
        facts.append(f"{seconds:.0f} s")
    passed = not problems
    return passed, ("GPU CHECK: PASS - " if passed else "GPU CHECK: FAIL - ") + "; ".join(
        problems + facts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_verdict", description=__doc__)
    p.add_argument("--junit", type=Path, required=True)
    p.add_argument("--bench", type=Path, required=True)
    p.add_argument("--failed-step", action="append", default=[])
    p.add_argument("--deselected", type=int, default=0)
    p.add_argument("--no-mooncake", type=int, default=0)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args(argv)
    try:
        bench = json.loads(args.bench.read_text())
    except (OSError, ValueError):
        bench = None
    passed, line = verdict(read_junit(args.junit), bench, args.failed_step,
                           deselected=args.deselected, no_mooncake=args.no_mooncake,
                           seconds=args.seconds)
    print(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
