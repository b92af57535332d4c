"""The processes of ``kvmove demo --processes N --direct``: one prefill process (a KV
cache and a :class:`kvmove.PageSender`) and decode processes (a layer-first
:class:`kvmove.HostPool` opened as a :class:`kvmove.PageReceiver`), each spawned with
``multiprocessing`` and driven by ``(op, args)`` commands over a pipe: ``"verify"``
(:meth:`DecodeSide.verify`), ``"prefill"`` (:meth:`PrefillSide.prefill`), ``("exit",
None)``. Every page has fixed bytes (:func:`kvmove.cli.synthetic_pages.page_bytes`), so a
decode process checks what it was sent without being told the bytes; a decode pool starts
filled with a sentinel that rows no send may write must still hold afterwards.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections import Counter

from kvmove.cli.synthetic_pages import ROWS

SENTINEL = 0xA5


def _buffers(layers: int, indexer_layers: int) -> dict[str, int]:
    """buffer name -> layers."""
    return {"kv": layers, **({"indexer": indexer_layers} if indexer_layers else {})}


class DecodeSide:
    """A layer-first host pool of ``pages`` pages, open to direct writes."""

    def __init__(self, *, layers: int, indexer_layers: int, page_tokens: int, pages: int):
        import torch

        import kvmove

        self.page_tokens = page_tokens
        self.layers = _buffers(layers, indexer_layers)
        self.pool_tensors = {
            name: torch.full((n, pages * page_tokens, ROWS[name]), SENTINEL, dtype=torch.uint8)
            for name, n in self.layers.items()}
        pool = kvmove.HostPool(self.pool_tensors, page_tokens=page_tokens,
                               layout="layer_first")
        self.receiver = kvmove.PageReceiver(pool)

    def verify(self, pages: list[int], dst: list[int], valid: list[int]) -> dict:
        """Page ``pages[i]`` must be in pool page ``dst[i]``, its first ``valid[i]`` rows
        exactly, the rest of the page still the sentinel; every pool page not in ``dst``
        all sentinel. Answers ``{"wrong": [..], "touched": [..], "bytes": n}``."""
        import torch

        from kvmove.cli.synthetic_pages import page_bytes

        p = self.page_tokens
        wrong, touched, nbytes = [], [], 0
        for page, d, v in zip(pages, dst, valid, strict=True):
            for name, t in self.pool_tensors.items():
                want = page_bytes(page, name, self.layers[name], p, ROWS[name])
                got = t[:, d * p:(d + 1) * p]
                if not torch.equal(got[:, :v], want[:, :v]):
                    wrong.append(page)
                    break
                if not bool((got[:, v:] == SENTINEL).all()):
                    touched.append(page)
                    break
                nbytes += got[:, :v].numel()
        unused = sorted(set(range(next(iter(self.pool_tensors.values())).shape[1] // p))
                        - set(dst))
        for d in unused:
            if any(not bool((t[:, d * p:(d + 1) * p] == SENTINEL).all())
                   for t in self.pool_tensors.values()):
                touched.append(f"pool page {d}")
        return {"wrong": wrong, "touched": touched, "bytes": nbytes}

    def close(self) -> None:
        self.receiver.close()


class PrefillSide:
    """A KV cache of ``pages`` pages and a sender."""

    def __init__(self, *, layers: int, indexer_layers: int, page_tokens: int, pages: int,
                 backend: str):
        import torch

        import kvmove

        self.torch = torch
        self.page_tokens = page_tokens
        self.layers = _buffers(layers, indexer_layers)
        slots = pages * page_tokens
        self.kv_tensors = {name: torch.zeros(n, slots, ROWS[name], dtype=torch.uint8)
                           for name, n in self.layers.items()}
        self.kv = kvmove.KVCache(self.kv_tensors)
        self.sender = kvmove.PageSender(self.kv, page_tokens=page_tokens,
                                        staging_slots=min(pages, 256), backend=backend)

    def prefill(self, handles: list[str], pages: list[int], dst: list[list[int]],
                valid: list[int]) -> dict:
        """Pages ``pages`` go to KV slots ``i * page_tokens ..`` (the ``i``-th page sent);
        each layer is "computed" (written) and then sent to every handle (``send(...,
        layers=l)``), the transfers waited for once at the end. ``dst``: one list per
        handle. Answers ``{"statuses": {status: count}, "seconds": s, "bytes": n}``."""
        from kvmove.cli.synthetic_pages import page_bytes

        torch, p = self.torch, self.page_tokens
        token_pages = torch.arange(len(pages) * p).reshape(len(pages), p)
        for i, v in enumerate(valid):
            token_pages[i, v:] = -1
        wanted = {name: torch.stack([page_bytes(page, name, n, p, ROWS[name])
                                     for page in pages], dim=1).reshape(n, -1, ROWS[name])
                  for name, n in self.layers.items()}
        t0 = time.perf_counter()  # the bytes above stand for the model: not timed
        transfers = []
        for layer in range(max(self.layers.values())):
            for name, n in self.layers.items():  # the layer's forward pass
                if layer < n:
                    self.kv_tensors[name][layer, :len(pages) * p] = wanted[name][layer]
            transfers += [self.sender.send(h, token_pages, d, layers=layer)
                          for h, d in zip(handles, dst, strict=True)]
        results = [t.result(60) for t in transfers]
        seconds = time.perf_counter() - t0
        statuses = Counter(s.value for r in results for s in r.statuses)
        return {"statuses": dict(statuses), "seconds": seconds,
                "bytes": sum(r.nbytes for r in results)}

    def close(self) -> None:
        self.sender.close()


def serve(conn, role: str, log_path: str | None, options: dict) -> None:
    """A node's process: make the side, answer commands until ``exit``."""
    if log_path is not None:  # Mooncake's log lines and ours go to the node's log file
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    side = None
    try:
        side = DecodeSide(**options) if role == "decode" else PrefillSide(**options)
        conn.send(("ready", {"pid": os.getpid(), "handle": getattr(
            getattr(side, "receiver", None), "handle", None)}))
        while True:
            op, args = conn.recv()
            if op == "exit":
                break
            try:
                conn.send(("ok", getattr(side, op)(**args)))
            except Exception as e:
                traceback.print_exc()
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except Exception as e:
        traceback.print_exc()
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if side is not None:
            side.close()
        sys.stderr.flush()


class Node:
    """The parent's handle on a node process; every call bounded by ``timeout`` s."""

    def __init__(self, role: str, log_path, options: dict, timeout: float = 120.0):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.role, self.timeout = role, timeout
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, role, log_path and str(log_path),
                                                    options), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self.handle = None

    def wait_ready(self) -> None:
        self.handle = self._answer()["handle"]

    def _answer(self):
        if not self._conn.poll(self.timeout):
            raise TimeoutError(f"{self.role} process pid {self.pid} gave no answer within "
                               f"{self.timeout:g} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.role} process pid {self.pid} exited "
                               f"({self.proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{self.role} process pid {self.pid}: {value}")
        return value

    def call(self, op: str, **args):
        self._conn.send((op, args))
        return self._answer()

    def close(self) -> int | None:
        """Ask the process to end (killed after ``timeout``); its exit code."""
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("exit", None))
            self.proc.join(self.timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
        self._conn.close()
        return self.proc.exitcode
