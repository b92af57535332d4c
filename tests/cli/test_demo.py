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



def test_demo_serves_metrics_scraped_over_http_during_the_run():
    # `kvmove demo --metrics-port P`: /metrics answers while the demo runs, and after it (for
    # --metrics-linger) holds the bytes the demo verified, under the kvmove_* names.
    import re
    import threading
    import time
    import urllib.request

    import pytest

    parser = pytest.importorskip("prometheus_client.parser")
    from kvmove.store.embedded_master import free_ports

    port = free_ports("127.0.0.1", 1)[0]
    args = [*SMALL, "--path", "staged", "--metrics-port", str(port), "--metrics-linger", "60"]
    proc = subprocess.Popen([sys.executable, "-m", "kvmove.cli", "demo", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, COLUMNS="120"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    during, after = [], []  # scrapes before the run's end is printed, and after
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not after:
            ended = any("still served" in line for line in lines)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            (after if ended else during).append(
                {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for f in parser.text_string_to_metric_families(text) for s in f.samples})
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        reader.join(timeout=10)
    out = "".join(lines)
    assert during and after, out
    verified = re.search(r"verified: (\d+) prefetched pages", out)
    assert verified, out
    pages = int(verified.group(1))
    page_bytes = 4 * 4 * (656 + 132)  # --layers 4, --page-tokens 4, both buffers
    got = (("direction", "prefetch"), ("stage", "get"))
    last = after[-1]
    assert last[("kvmove_bytes_total", got)] == pages * page_bytes
    assert last[("kvmove_keys_total", (("code", "OK"), ("direction", "prefetch"),
                                       ("status", "OK")))] == pages
    assert last[("kvmove_throughput_bytes_per_second", got)] > 0
    # scraped while the mover was working (it was built, and the run had not ended)
    assert any(s.get(("kvmove_movers_total", (("direction", "evict"), ("path", "staged"))))
               for s in during), out
    assert during[-1].get(("kvmove_bytes_total", got), 0) <= pages * page_bytes


def test_demo_metrics_options_are_checked_naming_them(monkeypatch, capsys):
    import pytest

    for bad, name in ((["--metrics-port", "70000"], "--metrics-port"),
                      (["--metrics-linger", "-1"], "--metrics-linger"),
                      (["--metrics-port", "0", "--processes", "2"], "--metrics-port")):
        with pytest.raises(SystemExit) as e:
            demo.main([*SMALL, *bad])
        assert e.value.code == 2 and name in capsys.readouterr().err
    monkeypatch.setenv("KVMOVE_METRICS_PORT", "http")
    with pytest.raises(SystemExit) as e:
        demo.main(SMALL)
    assert e.value.code == 2 and "KVMOVE_METRICS_PORT" in capsys.readouterr().err
