"""EmbeddedMaster: starts on free loopback ports, reports failures with its log, and never
outlives the process that started it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from kvmove.errors import StoreError
from kvmove.store.embedded_master import EmbeddedMaster, tcp_reachable

pytestmark = pytest.mark.store


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_start_and_stop():
    with EmbeddedMaster(kv_lease_ttl_ms=500) as master:
        assert master.running and tcp_reachable("127.0.0.1", master.rpc_port, 1.0)
        assert master.address == f"127.0.0.1:{master.rpc_port}"
        assert master.rpc_port != master.metrics_port
        assert "--default_kv_lease_ttl=500" in master.argv
        pid, log_path = master.pid, master.log_path
    assert _wait_gone(pid) and not master.running
    assert not os.path.exists(log_path)  # removed after a clean stop
    master.stop()  # idempotent


def test_stop_asks_then_kills_and_a_zero_grace_kills_at_once():
    asked = EmbeddedMaster(stop_timeout=5.0)
    asked.stop()
    assert asked.returncode == 0  # it ended on its own after SIGTERM
    killed = EmbeddedMaster(stop_timeout=0)
    pid, log_path = killed.pid, killed.log_path
    killed.stop()
    assert killed.returncode == -9 and _wait_gone(pid) and not os.path.exists(log_path)


def test_the_store_kills_its_private_master_at_close():
    import kvmove

    store = kvmove.MooncakeStore.embedded()
    master = store.master
    store.close()
    assert master.returncode == -9 and not master.running


@pytest.mark.parametrize("name, value", [("stop_timeout", -1), ("stop_timeout", "5"),
                                         ("start_timeout", 0), ("start_timeout", None)])
def test_bad_timeouts_are_named_before_anything_starts(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        EmbeddedMaster(**{name: value})


def test_failed_start_quotes_the_log():
    with pytest.raises(StoreError, match="no_such_flag") as err:
        EmbeddedMaster(extra_args=["--no_such_flag=1"])
    assert "exited with code" in str(err.value)
    log_path = re.search(r"log (\S+\.log):", str(err.value)).group(1)
    os.unlink(log_path)  # a failed start keeps its log for the user


@pytest.mark.parametrize("ending", ["sigkill", "exit_without_close"])
def test_master_never_outlives_its_process(ending):
    # The master is spawned from a short-lived thread, which must not matter.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        from kvmove.store.embedded_master import EmbeddedMaster
        box = []
        t = threading.Thread(target=lambda: box.append(EmbeddedMaster()))
        t.start(); t.join()
        print(box[0].pid, box[0].log_path, flush=True)
        if {ending!r} == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    pid, log_path = proc.stdout.split()
    assert _wait_gone(int(pid)), f"mooncake_master {pid} outlived its parent"
    if ending == "sigkill":  # nobody was left to remove the log
        os.unlink(log_path)
    assert not os.path.exists(log_path)
