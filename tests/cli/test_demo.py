"""The demo, the project's main job: it runs end to end on an embedded master, verifies every
prefetched byte, and fails (non-zero exit) when the bytes are wrong."""

from __future__ import annotations

import os
import subprocess
import sys

from kvmove.cli import demo
from kvmove.mover import staged_path

SMALL = ["--layers", "4", "--pages", "40", "--resident", "12", "--topk", "6", "--steps", "30",
         "--page-tokens", "4"]


def test_demo_command_verifies_and_exits_0():
    env = dict(os.environ, COLUMNS="120")
    proc = subprocess.run([sys.executable, "-m", "kvmove.cli", "demo", *SMALL],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified:" in proc.stdout
    assert "prefetch" in proc.stdout and "GB/s" in proc.stdout


def test_demo_fails_when_prefetched_bytes_are_wrong(monkeypatch, capsys):
    # A scatter that writes nothing leaves the scribbled rows: verification must catch it.
    real_copy = staged_path.run_pages
    monkeypatch.setattr(staged_path, "run_pages", lambda prepared, *a: None
                        if prepared.direction == "scatter" else real_copy(prepared, *a))
    assert demo.main([*SMALL, "--path", "staged"]) == 1
    out = capsys.readouterr().out
    assert "verification FAILED" in out
    assert "differs" in out


def test_demo_layerwise_with_triton_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["--layers", "2", "--indexer-layers", "1", "--pages", "16", "--resident", "6",
            "--topk", "3", "--steps", "8", "--page-tokens", "2", "--backend", "triton",
            "--layerwise"]
    assert demo.main(args) == 0
