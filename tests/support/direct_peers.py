"""Separate processes for the ``kvmove.direct`` tests: each :class:`Peer` is a process of
its own (``multiprocessing``, spawned) that hosts receivers (guarded pools, see
:mod:`tests.support.direct_pools`) and senders, driven by commands over a pipe. Every
call is bounded in time; a peer can be SIGKILLed or SIGSTOPped."""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback

from tests.support.direct_pools import kv_layers, make_pool


class _Host:
    """The in-process side of a peer."""

    def __init__(self):
        self.objects: dict[int, object] = {}
        self.pools: dict[int, dict] = {}

    def receiver(self, spec: dict, seed: int, hostname: str = "127.0.0.1") -> dict:
        import kvmove

        pool, wholes, _ = make_pool(spec, seed)
        rx = kvmove.PageReceiver(pool, hostname=hostname)
        key = len(self.objects)
        self.objects[key] = rx
        self.pools[key] = wholes
        return {"id": key, "handle": rx.handle}

    def read(self, key: int) -> dict:
        """Every byte of the receiver's buffers, guard bands included."""
        return {name: whole.numpy().tobytes() for name, whole in self.pools[key].items()}

    def sender(self, buffers: dict, slots: int, seed: int, page_tokens: int,
               staging_slots: int) -> dict:
        import kvmove

        kv = kvmove.KVCache(kv_layers(buffers, slots, seed))
        key = len(self.objects)
        self.objects[key] = kvmove.PageSender(kv, page_tokens=page_tokens,
                                              staging_slots=staging_slots, hostname="127.0.0.1")
        return {"id": key}

    def send(self, key: int, handle: str, token_pages, dst_pages, layers=None,
             layerwise: bool = False) -> dict:
        """One send (or, ``layerwise``, one per layer, waited for at the end)."""
        tx = self.objects[key]
        if not layerwise:
            return {"statuses": [s.value for s in
                                 tx.send(handle, token_pages, dst_pages, layers=layers).wait(60)]}
        transfers = [tx.send(handle, token_pages, dst_pages, layers=layer)
                     for layer in range(tx.kv.max_layers)]
        return {"statuses": [[s.value for s in t.wait(60)] for t in transfers]}

    def close(self, key: int) -> dict:
        self.objects.pop(key).close()
        self.pools.pop(key, None)
        return {}


def _serve(conn) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    host = _Host()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            op, kwargs = conn.recv()
        except EOFError:
            break
        if op == "exit":
            break
        try:
            conn.send(("ok", getattr(host, op)(**kwargs)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    for obj in host.objects.values():
        obj.close()
    conn.close()


class Peer:
    """A process of its own, answering :class:`_Host` calls. It starts at once; the first
    call waits until it is ready (so that several start side by side)."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        self._ready = False

    def _answer(self, timeout: float):
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer pid {self.proc.pid} gave no answer within {timeout} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"peer pid {self.proc.pid}: {value}")
        return value

    def call(self, op: str, timeout: float = 60.0, **kwargs):
        if not self._ready:
            self._answer(120.0)
            self._ready = True
        self._conn.send((op, kwargs))
        return self._answer(timeout)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def ask_to_exit(self) -> None:
        """Tell the process to close what it holds and end (without waiting)."""
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self._conn.send(("exit", {}))
            except (OSError, BrokenPipeError):
                pass

    def close(self) -> None:
        self.ask_to_exit()
        self.proc.join(30)
        self.kill()
        self._conn.close()
