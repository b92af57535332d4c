"""``PageReceiver``: a decode process's host pool, open to direct writes of its pages."""

from __future__ import annotations

import dataclasses
import weakref

from kvmove.direct.handle import BufferPlace, PageHandle
from kvmove.memory.host_pool import HostPool
from kvmove.store.transfer_engine import Engine, TransportSettings


def _close(engine: Engine, pool: HostPool) -> None:
    # ``pool`` is an argument only to keep its memory alive until the engine, which accepts
    # writes into it, is gone.
    engine.close()


class PageReceiver:
    """Opens ``pool`` (a :class:`kvmove.HostPool`: layer_first, page_first or
    page_first_direct, one buffer or several) to :class:`kvmove.PageSender` writes: a
    Transfer Engine registers exactly the pool's pages, and :attr:`handle` (a ``str``) is
    what senders are given. :meth:`close` (or a ``with`` block) destroys the engine: none
    lands after it returns. Raises ``TypeError`` for a pool that is not a ``HostPool``,
    ``ValueError`` for buffers that share memory or a bad ``MOONCAKE_*`` value,
    :class:`kvmove.KVMoveError` when the engine cannot be set up. No authentication, and
    it listens on every interface: see ``docs/API.md``, "Prefill -> decode host memory
    (direct transfer)".
    """

    def __init__(self, pool: HostPool, *, hostname: str | None = None):
        if not isinstance(pool, HostPool):
            raise TypeError(f"pool must be a kvmove.HostPool, got {type(pool).__name__}")
        settings = TransportSettings.from_env(local_hostname=hostname)
        places = tuple(
            BufferPlace.of_view(name, pool.tensor(name), layout=pool.layout,
                                layers=pool.num_layers(name), row_bytes=pool.row_bytes(name),
                                page_tokens=pool.page_tokens, num_pages=pool.num_slots)
            for name in pool.buffer_names)
        # Checked before anything is opened (the peer's name is known once it is).
        unbound = PageHandle("unbound:0", pool.layout, pool.page_tokens, pool.num_slots,
                             places)
        # A name of its own beside other engines of this process (a store client's, other
        # receivers'), unless the caller named its port.
        engine = Engine(settings if settings.has_port else settings.named_apart())
        try:
            engine.register([(p.address, p.nbytes) for p in places])
            handle = dataclasses.replace(unbound, peer=engine.peer)
        except BaseException:
            engine.close()
            raise
        self.pool = pool
        self.peer = engine.peer
        self.handle = handle.encode()
        self._finalizer = weakref.finalize(self, _close, engine, pool)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy the engine (see the class doc). Idempotent."""
        self._finalizer()

    def __enter__(self) -> PageReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PageReceiver({self.peer}, {self.pool!r}, {'closed' if self.closed else 'open'})"
