"""What a new user tried, each time: a bad value or a failed start gives one line naming the
cause and a non-zero exit (2 for usage errors), never a traceback or a misleading "ready";
``MOONCAKE_MASTER`` is honoured wherever a master is used; third-party logs stay quiet
unless ``-v`` (library use too); no stray files are left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import kvmove

ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKE_", "MC_"))}
ENV["COLUMNS"] = "200"
TINY = ["--layers", "2", "--indexer-layers", "1", "--pages", "24", "--page-tokens", "4",
        "--steps", "3"]


def kvmove_cmd(*args, env=None, timeout=180, tmp=None):
    environ = {**ENV, **(env or {})}
    if tmp is not None:
        environ["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, "-m", "kvmove.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=environ)


def one_line(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["--topk", "16", "--resident", "16"], ["--resident", "1"]])
def test_demo_pages_that_cannot_all_be_resident_are_a_usage_error(args):
    proc = kvmove_cmd("demo", *args)
    assert proc.returncode == 2
    assert "--resident" in one_line(proc)


@pytest.mark.store
@pytest.mark.parametrize("args", [["--topk", "100"], ["--resident", "8"]])
def test_a_value_given_alone_is_kept_and_the_demo_runs(args, tmp_path):
    # These crashed with "IndexError: pop from empty list": a default must fit the value given.
    proc = kvmove_cmd("demo", *TINY, *args, tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified:" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no log file left behind


@pytest.mark.parametrize(("variable", "value", "cause"), [
    ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "lots", "MOONCAKE_GLOBAL_SEGMENT_SIZE"),
    ("MOONCAKE_PROTOCOL", "rmda", "did you mean 'rdma'"),
    ("MOONCAKE_MASTER", "no-port", "MOONCAKE_MASTER"),
])
def test_a_malformed_mooncake_variable_is_one_line_exit_2_before_anything_waits(
        variable, value, cause):
    t0 = time.monotonic()
    proc = kvmove_cmd("demo", *TINY, env={variable: value}, timeout=60)
    assert proc.returncode == 2
    assert cause in one_line(proc)
    assert time.monotonic() - t0 < 30  # no 25 s wait on a transport that does not exist


def test_an_unreachable_master_is_one_line_for_both_demos():
    for args in (["--processes", "2", "--master", "127.0.0.1:1"], ["--master", "127.0.0.1:1"]):
        proc = kvmove_cmd("demo", *TINY, *args, timeout=60)
        assert proc.returncode == 1
        out = [ln for ln in proc.stdout.splitlines() if "cannot reach" in ln]
        assert len(out) == 1 and "127.0.0.1:1" in out[0], proc.stdout + proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.store
def test_mooncake_master_from_the_environment_is_used_by_both_demos(tmp_path):
    with kvmove.EmbeddedMaster() as master:
        env = {"MOONCAKE_MASTER": master.address, "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
               "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64mb"}
        proc = kvmove_cmd("demo", *TINY, env=env, tmp=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"MooncakeStore({master.address}, remote" in proc.stdout
        proc = kvmove_cmd("demo", "--processes", "2", "--pages", "8", "--layers", "2",
                          env=env, tmp=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"master {master.address}" in proc.stdout and "embedded" not in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_second_master_on_a_busy_port_says_so_and_never_ready():
    with kvmove.EmbeddedMaster() as first:
        proc = kvmove_cmd("master", "--port", str(first.rpc_port), timeout=60)
    assert proc.returncode == 1
    assert "MOONCAKE_MASTER=" not in proc.stdout and "ready" not in proc.stderr
    assert f"port {first.rpc_port}" in one_line(proc) and "in use" in one_line(proc)


def test_a_master_on_a_foreign_address_is_one_line():
    proc = kvmove_cmd("master", "--host", "10.1.2.3", "--port", "50999", timeout=60)
    assert proc.returncode == 1
    assert "10.1.2.3 is not an address of this machine" in one_line(proc)


@pytest.mark.store
def test_master_keeps_mooncake_log_out_of_the_terminal_unless_verbose(tmp_path):
    from tests.cli.test_cli import free_port

    for verbose in (False, True):
        port = free_port()
        argv = [sys.executable, "-m", "kvmove.cli", "master", "--port", str(port)]
        proc = subprocess.Popen(argv + (["-v"] if verbose else []), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**ENV, "TMPDIR": str(tmp_path)})
        try:
            assert proc.stdout.readline().startswith("MOONCAKE_MASTER=")
            config = kvmove.StoreConfig(master_address=f"127.0.0.1:{port}",
                                        local_hostname="127.0.0.1",
                                        global_segment_size=32 << 20)
            with kvmove.MooncakeStore(config) as store:  # the master logs a client's visit
                assert store.exists(["x"]) == [False]
        finally:
            proc.send_signal(2)
            err = proc.communicate(timeout=30)[1]
        glog = [ln for ln in err.splitlines() if ln[:1] in "IWE" and ln[1:5].isdigit()]
        assert bool(glog) == verbose, err
        assert proc.returncode == 0
    assert list(tmp_path.iterdir()) == []  # the quiet run's log file was removed


@pytest.mark.store
def test_library_use_prints_no_mooncake_lines(tmp_path):
    code = ("import kvmove\n"
            "with kvmove.MooncakeStore.embedded(global_segment_size=32 << 20) as s:\n"
            "    assert s.exists(['x']) == [False]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**ENV, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_the_triton_backend_on_a_cpu_says_it_is_slow():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = kvmove_cmd("demo", "--backend", "triton", "--layers", "1", "--indexer-layers", "0",
                      "--pages", "3", "--page-tokens", "2", "--resident", "3", "--topk", "1",
                      "--steps", "0", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreter" in proc.stdout and "--backend torch" in proc.stdout
