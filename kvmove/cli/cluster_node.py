"""An engine process of a kvmove cluster, for ``kvmove demo --processes N`` and the
multi-process tests: a synthetic DSA-like KV cache, a :class:`kvmove.MooncakeStore` on a
shared master and a :class:`kvmove.KVMover`, driven by JSON commands, one a line, on its
standard input: ``{"op": "evict" | "prefetch", "pages": [..]}``, ``{"op": "stats"}``,
``{"op": "exit"}`` (see :class:`ClusterNode`'s methods). Every page has fixed bytes (a
function of the page number and the buffer), so any process can check what another
evicted. Each answer is one line of standard output starting with ``ANSWER_TAG`` (any other
output, Mooncake's included, is not an answer). :class:`NodeProcess` is the parent's handle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvmove.cli.synthetic_pages import ROWS

ANSWER_TAG = "KVMOVE-NODE "
SENTINEL = 0xA5


class ClusterNode:
    """The in-process side: a cache of ``resident`` pages, a store, a mover."""

    def __init__(self, store, *, layers: int, page_tokens: int, resident: int,
                 key_prefix: str, rows: dict[str, int] | None = None, path: str = "auto"):
        import torch

        import kvmove

        self.torch = torch
        self.store = store
        self.layers, self.page_tokens, self.resident = layers, page_tokens, resident
        self.rows = dict(rows or ROWS)
        slots = resident * page_tokens
        self.buffers = {name: torch.zeros(layers, slots, row, dtype=torch.uint8)
                        for name, row in self.rows.items()}
        self.kv = kvmove.KVCache(self.buffers)
        self.mover = kvmove.KVMover(self.kv, store, page_tokens=page_tokens,
                                    staging_slots=resident, key_prefix=key_prefix, path=path)

    def page_bytes(self, page: int, name: str):
        """The bytes of ``page`` in buffer ``name``: ``[layers, page_tokens, row]``."""
        from kvmove.cli.synthetic_pages import page_bytes

        return page_bytes(page, name, self.layers, self.page_tokens, self.rows[name])

    def _rows(self, count: int):
        torch = self.torch
        if not 0 < count <= self.resident:
            raise ValueError(f"a command moves 1..{self.resident} pages, got {count}")
        return torch.arange(count * self.page_tokens).reshape(count, self.page_tokens)

    @staticmethod
    def keys(pages: Sequence[int]) -> list[str]:
        return [f"p{p}" for p in pages]

    def evict(self, pages: Sequence[int], where: bool = False) -> dict:
        """Write each page's bytes into the hot buffer and evict it: ``{"statuses",
        "seconds"}``; with ``where`` also ``"replicas"``, per page the transport endpoints
        of its replicas' holders (``[]`` when not stored)."""
        rows = self._rows(len(pages))
        for name, buf in self.buffers.items():
            want = self.torch.stack([self.page_bytes(p, name) for p in pages], dim=1)
            buf[:, rows.reshape(-1)] = want.reshape(self.layers, -1, self.rows[name])
        t0 = time.perf_counter()
        statuses = self.mover.evict(self.keys(pages), rows).wait()
        answer = {"statuses": [s.value for s in statuses],
                  "seconds": time.perf_counter() - t0}
        if where:
            keys = self.mover.keyspace.store_keys(self.keys(pages))
            answer["replicas"] = [[r.endpoint for r in found]
                                  for found in self.store.replicas(keys)]
        return answer

    def stats(self) -> dict:
        """``{"free_slots", "slots", "rss", "threads"}``: the mover's free staging slots
        (slots held for store calls that timed out come back when those return), this
        process's resident bytes and its thread count."""
        import threading

        rss = 0
        with contextlib.suppress(OSError), open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        staging = self.mover.staging
        return {"free_slots": staging.num_free, "slots": staging.num_slots, "rss": rss,
                "threads": threading.active_count()}

    def prefetch(self, pages: Sequence[int]) -> dict:
        """Fill the target rows with a sentinel, prefetch, check every row: a page ``ok``
        must hold exactly its bytes (else it is in ``"wrong"``), any other page still the
        sentinel (else in ``"touched"``). ``{"statuses", "wrong", "touched", "seconds",
        "bytes"}``."""
        rows = self._rows(len(pages))
        for buf in self.buffers.values():
            buf[:, rows.reshape(-1)] = SENTINEL
        t0 = time.perf_counter()
        statuses = self.mover.prefetch(self.keys(pages), rows).wait()
        seconds = time.perf_counter() - t0
        wrong, touched, nbytes = [], [], 0
        for i, (page, status) in enumerate(zip(pages, statuses, strict=True)):
            page_rows = rows[i]
            for name, buf in self.buffers.items():
                got = buf[:, page_rows]
                if status.value == "ok":
                    if not self.torch.equal(got, self.page_bytes(page, name)):
                        wrong.append(page)
                        break
                    nbytes += got.numel()
                elif not bool((got == SENTINEL).all()):
                    touched.append(page)
                    break
        return {"statuses": [s.value for s in statuses], "wrong": wrong, "touched": touched,
                "seconds": seconds, "bytes": nbytes}

    def close(self) -> None:
        self.mover.close()
        self.store.close()


def serve(node: ClusterNode, commands, answers) -> None:
    """Answer ``commands`` (lines of JSON) on ``answers`` until ``exit`` or end of input."""
    for line in commands:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        if op == "exit":
            break
        try:
            if op == "evict":
                answer = node.evict(command["pages"], bool(command.get("where")))
            elif op == "prefetch":
                answer = node.prefetch(command["pages"])
            elif op == "stats":
                answer = node.stats()
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as e:  # answered, so the parent sees why
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(ANSWER_TAG + json.dumps(answer) + "\n")
        answers.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmove.cli.cluster_node", description=__doc__)
    p.add_argument("--master", required=True, help="host:port of the Mooncake master")
    p.add_argument("--replicas", type=int, default=1, help="replicas of every object")
    p.add_argument("--segment", default="256mb", help="bytes this process gives the store")
    p.add_argument("--layers", type=int, default=4, help="layers of each buffer")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page")
    p.add_argument("--resident", type=int, default=64, help="pages of KV cache")
    p.add_argument("--key-prefix", default="cluster", help="namespace of the keys")
    p.add_argument("--rows", default=",".join(f"{k}={v}" for k, v in ROWS.items()),
                   help="buffers and their row bytes, e.g. 'kv=656,indexer=132'")
    args = p.parse_args(argv)
    rows = {}
    for item in args.rows.split(","):
        name, _, size = item.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            p.error(f"--rows: {item!r} is not name=bytes")
        rows[name] = int(size)
    import kvmove

    store = kvmove.MooncakeStore(kvmove.StoreConfig.from_env(
        master_address=args.master, replicas=args.replicas, global_segment_size=args.segment,
        local_hostname=os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")))
    node = ClusterNode(store, layers=args.layers, page_tokens=args.page_tokens,
                       resident=args.resident, key_prefix=args.key_prefix, rows=rows)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    answers.write(ANSWER_TAG + json.dumps({"ready": os.getpid()}) + "\n")
    answers.flush()
    try:
        serve(node, sys.stdin, answers)
    finally:
        node.close()
    return 0


class NodeProcess:
    """The parent's handle on a :mod:`kvmove.cli.cluster_node` process. ``log_path`` receives
    the process's standard error (Mooncake's log among it). Every call is bounded by
    ``timeout`` seconds."""

    def __init__(self, master: str, *, log_path: str | os.PathLike | None, replicas: int = 1,
                 segment: str = "256mb", layers: int = 4, page_tokens: int = 16,
                 resident: int = 64, key_prefix: str = "cluster", env: dict | None = None,
                 timeout: float = 60.0, rows: dict[str, int] | None = None):
        argv = [sys.executable, "-m", "kvmove.cli.cluster_node", f"--master={master}",
                f"--replicas={replicas}", f"--segment={segment}", f"--layers={layers}",
                f"--page-tokens={page_tokens}", f"--resident={resident}",
                f"--key-prefix={key_prefix}"]
        if rows:
            argv.append("--rows=" + ",".join(f"{k}={v}" for k, v in rows.items()))
        self.log_path = None if log_path is None else Path(log_path)
        environ = {**os.environ, **(env or {})}
        environ.setdefault("MC_LOG_LEVEL", "ERROR")
        root = str(Path(__file__).resolve().parent.parent)
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, environ.get("PYTHONPATH")) if p)
        with open(self.log_path or os.devnull, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=None if self.log_path is None else log, env=environ, text=True,
                bufsize=1)
        self._buffer = ""
        self.timeout = timeout
        self.pid = self.proc.pid
        self._read_answer(timeout)

    def _read_answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while "\n" in self._buffer:
                line, self._buffer = self._buffer.split("\n", 1)
                if line.startswith(ANSWER_TAG):
                    return json.loads(line[len(ANSWER_TAG):])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node pid {self.pid} gave no answer within {timeout:g}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536).decode(errors="replace")
                if not chunk:
                    raise RuntimeError(
                        f"node pid {self.pid} exited ({self.proc.wait()}) without answering; "
                        f"log {self.log_path}:\n{self.log_tail()}")
                self._buffer += chunk

    def call(self, op: str, timeout: float | None = None, **fields) -> dict:
        """Send one command and return its answer (``RuntimeError`` for an answered
        error)."""
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._read_answer(self.timeout if timeout is None else timeout)
        if "error" in answer:
            raise RuntimeError(f"node pid {self.pid}: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None:
            return "(on this process's stderr)"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(log unreadable: {e})"

    def kill(self) -> None:
        """SIGKILL: the process dies holding whatever it holds."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self, timeout: float = 30.0) -> int:
        """Ask the process to exit (closing its store), kill it after ``timeout``; its exit
        code."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())
