"""The ``kvmove`` command as a user runs it: fast help without torch, help texts on every
option, ``-v`` on either side of the subcommand, one-line errors with exit 2 for bad values,
``kvmove master`` started and stopped, ``kvmove doctor``, the two-process demo."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

import kvmove
from kvmove.cli import command as cli

ENV = dict(os.environ, COLUMNS="120")


def kvmove_cmd(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "kvmove.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or ENV)


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys, kvmove.cli.command as c; c.build_parser().format_help(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    proc = kvmove_cmd("--help")
    assert proc.returncode == 0 and "master" in proc.stdout and "doctor" in proc.stdout


def test_every_option_has_a_help_text():
    from kvmove.cli.tune import build_parser as tune_parser

    parser = cli.build_parser()
    subparsers = dict(parser._subparsers._group_actions[0].choices)
    subparsers["tune"] = tune_parser()
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"kvmove {name} {action.option_strings or action.dest}"


@pytest.mark.parametrize("argv", [["-v", "tune"], ["tune", "-v"], ["doctor", "-v"],
                                  ["-v", "doctor"]])
def test_verbose_before_or_after_the_subcommand(argv):
    args, rest, _ = cli.parse(argv)
    assert args.verbose == 1 and rest == []


def test_tune_v_runs():
    proc = kvmove_cmd("tune", "-v")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("args", "option"), [
    (["--pages", "-5"], "--pages"),
    (["--page-tokens", "0"], "--page-tokens"),
    (["--layers", "0"], "--layers"),
    (["--staging-slots", "1"], "--staging-slots"),
    (["--device", "cuda"], "--device"),
    (["--topk", "9", "--resident", "4"], "--topk"),
    (["--processes", "0"], "--processes"),
    (["--master", "no-port"], "--master"),
])
def test_bad_demo_values_are_one_line_exit_2(args, option):
    if option == "--device" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = kvmove_cmd("demo", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and "Traceback" not in proc.stderr, lines


def test_bad_master_values_are_one_line_exit_2():
    proc = kvmove_cmd("master", "--port", "70000")
    assert proc.returncode == 2 and "--port" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.store
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_master_prints_the_address_serves_and_stops_cleanly(sig):
    from tests.support.process_table import masters_on_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvmove.cli", "master", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline().strip()  # bounded by the master's start timeout
        assert line == f"MOONCAKE_MASTER=127.0.0.1:{port}", (line, proc.stderr.read())
        assert masters_on_port(port)
        config = kvmove.StoreConfig(master_address=line.split("=", 1)[1],
                                    local_hostname="127.0.0.1", global_segment_size=32 << 20)
        with kvmove.MooncakeStore(config) as store:
            assert store.exists(["nothing-here"]) == [False]
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        err = proc.stderr.read()
        assert "loopback only" in err and "stopped" in err
        assert masters_on_port(port) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_doctor_reports_and_names_the_fix(tmp_path):
    proc = kvmove_cmd("doctor", env={k: v for k, v in ENV.items()
                                     if not k.startswith("MOONCAKE_")})
    for topic in ("GPU", "torch", "Triton", "Mooncake", "libibverbs", "memlock",
                  "tuned table", "master", "in place"):
        assert topic in proc.stdout
    assert "over tcp: KV caches in host memory can move in place" in proc.stdout
    assert proc.returncode == 0, proc.stdout
    proc = kvmove_cmd("doctor", "--timeout", "0.5", env={**ENV, "MOONCAKE_MASTER": "127.0.0.1:1"})
    assert proc.returncode == 1
    assert "PROBLEM master" in proc.stdout and "fix:" in proc.stdout


@pytest.mark.store
def test_demo_with_two_processes_verifies():
    proc = kvmove_cmd("demo", "--processes", "2", "--pages", "96", "--layers", "4",
                      timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout and "96 pages" in proc.stdout
    assert "Local segment descriptor" not in proc.stdout + proc.stderr


@pytest.mark.store
def test_demo_with_two_processes_fails_on_a_mismatch(monkeypatch):
    from kvmove.cli import cluster_demo, demo

    real = cluster_demo._decode

    def decode_with_a_wrong_page(node, pages, unknown):
        result = real(node, pages, unknown)
        result["wrong"].append(pages[0])
        return result

    monkeypatch.setattr(cluster_demo, "_decode", decode_with_a_wrong_page)
    assert demo.main(["--processes", "2", "--pages", "16", "--layers", "2"]) == 1
