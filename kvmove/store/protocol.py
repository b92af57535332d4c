"""``Store``: what the mover, the direct sender and the engine integrations need of a store.

``MooncakeStore`` is the store kvmove ships; the tests' in-memory store implements the same
protocol. Every call answers one :class:`kvmove.Status` per key (a ``StoreResult``), never
an exception that loses the other keys' results; the contract is ``docs/API.md``, "The
store"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvmove.objects.descriptors import Descriptors
    from kvmove.store.results import StoreResult


@runtime_checkable
class PendingStorePut(Protocol):
    """A put begun before its descriptors were made (:meth:`Store.begin_put`)."""

    def put(self, desc: Descriptors) -> StoreResult: ...

    def close(self) -> None: ...

    def __enter__(self) -> PendingStorePut: ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class Store(Protocol):
    """A key-value store of multi-span objects, read and written zero-copy.

    ``transport``: what its transfers run over (``"tcp"``, ``"rdma"``), or ``None`` for a
    store that cannot read a KV cache's rows in place. ``address``: the master's, for logs
    and for the record of the path a mover chose."""

    @property
    def transport(self) -> str | None: ...

    @property
    def address(self) -> str: ...

    def register(self, staging) -> None: ...

    def unregister(self, staging) -> None: ...

    def put(self, desc: Descriptors, *, detect_exists: bool | None = None,
            until_returned: bool = False) -> StoreResult: ...

    def begin_put(self, keys: Sequence[str], *, detect_exists: bool | None = None
                  ) -> PendingStorePut: ...

    def get(self, desc: Descriptors, *, until_returned: bool = False) -> StoreResult: ...

    def exists(self, keys: Sequence[str]) -> StoreResult: ...

    def remove(self, keys: Sequence[str], *, force: bool = False) -> StoreResult: ...

    def close(self) -> None: ...
