"""Runs the public-API fuzzer (tests/fuzz_public_api.py) in a child process, so that a crash
of the process (not only an exception) fails the test, and reports what each case produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

EXAMPLES = int(os.environ.get("KVMOVE_FUZZ_EXAMPLES", "150"))


def test_fuzzing_every_public_function_never_crashes_or_corrupts():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_public_api", "--examples", str(EXAMPLES)],
        capture_output=True, text=True, timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, (
        f"fuzzer exited with {proc.returncode} (a negative code is a signal: the process "
        f"crashed)\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    outcomes = summary["outcomes"]
    print(json.dumps(outcomes, indent=1, sort_keys=True))
    # Each target was exercised both ways: valid calls succeed, bad ones are rejected.
    for target in ("gather", "scatter", "copy_rows", "describe", "KVCache"):
        assert outcomes.get(f"{target}: accepted", 0) > 0, target
        assert any(k.startswith(f"{target}: rejected") for k in outcomes), target
    assert outcomes["copy_rows check=False: counted"] == EXAMPLES
