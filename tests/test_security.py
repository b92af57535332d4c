"""Security: the embedded master listens on loopback only, nothing in kvmove builds a shell
command, and user input reaches the master's argv only as separate arguments.
(Malformed ``MOONCAKE_*`` values: tests/store/test_store_config.py.)"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from kvmove.errors import StoreError
from kvmove.store.embedded_master import BINARY_ENV, EmbeddedMaster
from tests.support.process_table import listening_addresses

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = [ROOT / "kvmove"]


@pytest.mark.store
def test_embedded_master_listens_on_loopback_only(store):
    master = store.master
    listening = listening_addresses(master.pid)
    # The RPC and metrics ports, and nothing on another address (0.0.0.0, ::, a NIC's).
    assert f"127.0.0.1:{master.rpc_port}" in listening
    assert f"127.0.0.1:{master.metrics_port}" in listening
    assert all(a.startswith(("127.0.0.1:", "[::1]:")) for a in listening), listening
    assert "--rpc_address=127.0.0.1" in master.argv
    assert "--metrics_host=127.0.0.1" in master.argv
    assert not any("http_metadata_server" in a for a in master.argv)


def _shell_calls(path: Path) -> list[str]:
    """Calls in ``path`` that run a shell: ``shell=`` anything but ``False``,
    ``os.system``, ``os.popen``, ``subprocess.getoutput`` / ``getstatusoutput``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func in ("os.system", "os.popen", "subprocess.getoutput",
                    "subprocess.getstatusoutput", "system", "popen"):
            found.append(f"{path.name}:{node.lineno}: {func}(...)")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                          and kw.value.value is False):
                found.append(f"{path.name}:{node.lineno}: shell={ast.unparse(kw.value)}")
    return found


def test_no_shell_command_is_built_anywhere_in_the_package():
    files = [p for d in PACKAGE_DIRS for p in d.rglob("*.py")]
    assert len(files) > 10
    found = [hit for p in files for hit in _shell_calls(p)]
    assert found == []
    # and the text search the reviewers will run
    pattern = re.compile(r"shell\s*=\s*True|os\.system\(|os\.popen\(")
    assert [str(p) for p in files if pattern.search(p.read_text())] == []


def test_the_shell_scanner_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os, subprocess\nos.system('x')\nsubprocess.run('x', shell=True)\n"
                   "subprocess.run(['x'], shell=flag)\nos.popen('x')\n"
                   "subprocess.run(['x'], shell=False)\n")
    assert len(_shell_calls(bad)) == 4


def test_master_argv_is_a_list_and_user_input_stays_one_argument(monkeypatch, tmp_path):
    calls = []
    real = subprocess.Popen

    def spy(argv, *args, **kwargs):
        calls.append((argv, kwargs))
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    marker = tmp_path / "pwned"
    hostile = f"--default_kv_lease_ttl=1000;touch {marker} $(touch {marker}) `touch {marker}`"
    with pytest.raises(StoreError, match="exited with code") as err:
        EmbeddedMaster(extra_args=[hostile], start_timeout=10)
    log_path = re.search(r"log (\S+\.log):", str(err.value)).group(1)
    os.unlink(log_path)  # a failed start keeps its log for the user
    assert calls, "the master was not started through subprocess.Popen"
    argv, kwargs = calls[0]
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    assert argv[-1] == hostile  # one argument, passed as it is
    assert not kwargs.get("shell", False)
    assert not marker.exists()


def test_hostile_binary_path_is_not_run(monkeypatch, tmp_path):
    marker = tmp_path / "pwned"
    monkeypatch.setenv(BINARY_ENV, f"mooncake_master; touch {marker}")
    with pytest.raises(StoreError, match="not an executable file"):
        EmbeddedMaster()
    assert not marker.exists()
