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
    page_first_direct, one buffer or several) to :class:`kvmove.PageSender` writes.

    It makes a Mooncake Transfer Engine (settings from the ``MOONCAKE_*`` variables;
    ``hostname`` overrides ``MOONCAKE_LOCAL_HOSTNAME``, the address senders reach this
    process at, which goes into the handle), registers exactly the bytes of the pool's
    pages (one region per buffer) and nothing else, and publishes :attr:`handle`: a
    ``str`` to hand to senders through the engine's own bootstrap channel. Writes land
    while the receiver is open; the receiver learns nothing of them (the sender tells it,
    through that channel, what its ``Transfer`` reported). A write aimed outside the
    registered pool (a forged or stale handle) is refused by the engine and changes
    nothing.

    Security: the transport has no authentication and no encryption. Whoever reaches the
    engine's ports can write into, and read, the registered pool. The engine listens on
    every interface (``0.0.0.0`` and ``[::]``) whatever ``MOONCAKE_LOCAL_HOSTNAME`` says:
    Mooncake 0.3.13 does not bind to one address under peer-to-peer handshake. Keep its
    port range (``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``, 15000-17000 by default, two ports
    per engine) on the cluster's own network, or firewall it.

    :meth:`close` (or leaving a ``with`` block) destroys the engine: writes in flight then
    fail at their senders (``FAILED``), and none lands after it returns; the pool's memory
    is the caller's again. Pages a sender reported ``FAILED`` may hold part of the write
    (a write is not atomic): treat them as dirty. Raises ``TypeError`` for a pool that is
    not a ``HostPool``, ``ValueError`` for buffers that share memory or a bad
    ``MOONCAKE_*`` value, :class:`kvmove.KVMoveError` when the engine cannot be set up
    (nothing stays registered then).
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
