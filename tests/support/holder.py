"""A store node for the cluster tests: a process that only gives the Mooncake store memory (a
plain Mooncake client with a segment, as a store-only node of a deployment is), quick to
start and to kill. Run as ``python -m tests.support.holder MASTER SEGMENT_BYTES``; it prints
``READY <segment name>`` once set up and then sleeps until killed (or its stdin closes).

:class:`Holder` is the parent's handle; ``endpoint`` is the transport endpoint its replicas
are listed under (found from the sockets it listens on)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.process_table import listening_addresses

ROOT = Path(__file__).resolve().parent.parent.parent


class Holder:
    """A holder process on ``master`` giving ``segment`` bytes; its log goes to
    ``log_path``."""

    def __init__(self, master: str, *, segment: int = 512 << 20, log_path=None,
                 timeout: float = 30.0):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MC_LOG_LEVEL": "ERROR"}
        with open(log_path or os.devnull, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.holder", master, str(segment)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                cwd=ROOT)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"holder pid {self.pid} did not start: {line!r}")
        self.name = line.split()[1]
        # Its transport endpoint (where its replicas are listed) is one of the ports it
        # listens on (bound to 0.0.0.0 or [::]); reached at 127.0.0.1.
        self.endpoints = set()
        deadline = time.monotonic() + timeout
        while not self.endpoints and time.monotonic() < deadline:
            self.endpoints = {"127.0.0.1:" + a.rpartition(":")[2]
                              for a in listening_addresses(self.pid)}
            if not self.endpoints:
                time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=10)

    def close(self) -> None:
        """Resume (if stopped) and kill; a holder has nothing to save."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


def main(argv: list[str]) -> int:
    from mooncake.store import MooncakeDistributedStore

    master, segment = argv[0], int(argv[1])
    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"FAILED setup {rc}", flush=True)
        return 1
    print("READY", client.get_hostname(), flush=True)
    sys.stdin.read()  # until the parent closes stdin, or kills this process
    os._exit(0)  # no goodbye to the master: as a crash would


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
