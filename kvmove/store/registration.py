"""The memory regions registered with the store's client, and which of them put/get calls
are using now: ``unregister`` refuses a region in use instead of pulling memory from under a
transfer, and a registration never outlives its memory (a staging buffer's regions go when
it is garbage-collected; a region overlapping a new one is unregistered first)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from concurrent.futures import Future

import numpy as np

from kvmove.errors import StoreError
from kvmove.memory.mapped import check_mapped
from kvmove.objects.descriptors import Descriptors
from kvmove.objects.span_check import check_spans
from kvmove.status import code_name
from kvmove.store.clients import ClientState

log = logging.getLogger(__name__)


def regions_of(staging) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` regions of a staging buffer (or of such a list)."""
    regions = staging.regions() if hasattr(staging, "regions") else staging
    try:
        return [(int(a), int(n)) for a, n in regions]
    except (TypeError, ValueError):
        raise TypeError(
            "expected a StagingBuffer (or its (address, nbytes) regions), got "
            f"{type(staging).__name__}"
        ) from None


class Uses:
    """What a put/get tells :meth:`Registrations.using` at its end: the future of its calls
    that timed out, if any."""

    __slots__ = ("late",)

    def __init__(self):
        self.late = None


class Registrations:
    """Registers regions with the state's current client (and the replica reader, once
    made) and counts their users. The caller of :meth:`register` and :meth:`unregister`
    holds ``state.register_lock``."""

    def __init__(self, state: ClientState):
        self.state = state

    def register(self, staging) -> None:
        """Register the regions of ``staging`` that are not registered yet. Raw regions (a
        list, not a kvmove object's ``regions()``) must be memory of this process
        (:func:`~kvmove.memory.mapped.check_mapped`: ``ValueError``, nothing registered)."""
        regions = regions_of(staging)
        state = self.state
        if not hasattr(staging, "regions"):
            check_mapped([r for r in regions if state.registered.get(r[0]) != r[1]])
        client = state.client  # the current one (a replacement swaps under the lock)
        self._drop_stale(client)
        added = False
        for address, nbytes in regions:
            if state.registered.get(address) == nbytes:
                continue
            for old, size in list(state.registered.items()):
                if old < address + nbytes and address < old + size:  # freed memory
                    if state.in_use[old]:
                        raise StoreError(
                            f"cannot register {address:#x} + {nbytes}: it overlaps the "
                            f"registered region {old:#x} + {size}, which "
                            f"{state.in_use[old]} put/get call(s) are using"
                        )
                    client.unregister_buffer(old)
                    del state.registered[old]
                    if state.reader is not None:
                        state.reader.unregister(old)
                    log.debug("unregistered stale region %#x + %d", old, size)
            rc = client.register_buffer(address, nbytes)
            if rc != 0:
                raise StoreError(
                    f"register_buffer({address:#x}, {nbytes}) failed with code {rc} "
                    f"({code_name(rc)})"
                )
            state.registered[address] = nbytes
            if state.reader is not None:
                try:
                    state.reader.register(address, nbytes)
                except StoreError as e:
                    log.warning("%s (replica failover cannot read into that region)", e)
            added = True
            log.debug("registered %#x + %d", address, nbytes)
        if added and hasattr(staging, "regions"):
            # Forget the regions when the staging dies: the finalizer only queues them
            # (it may run inside any allocation, even with the lock held here).
            with contextlib.suppress(TypeError):
                weakref.finalize(staging, state.stale.append, tuple(regions))

    def _drop_stale(self, client) -> None:
        """Unregister regions of staging buffers that were garbage-collected."""
        state = self.state
        while state.stale:
            for address, nbytes in state.stale.popleft():
                if state.registered.get(address) == nbytes:
                    del state.registered[address]
                    client.unregister_buffer(address)
                    if state.reader is not None:
                        state.reader.unregister(address)

    def unregister(self, staging) -> None:
        """Unregister the regions of ``staging``; :class:`kvmove.StoreError`, and nothing
        unregistered, while a put or get is using one of them."""
        regions = regions_of(staging)
        state = self.state
        busy = [(a, state.in_use[a]) for a, _ in regions if state.in_use[a]]
        if busy:
            address, calls = busy[0]
            raise StoreError(
                f"cannot unregister the staging region {address:#x}: {calls} put/get "
                f"call(s) in flight are using it (wait for the transfers to end first)"
            )
        client = state.client
        for address, _ in regions:
            if state.registered.pop(address, None) is not None:
                rc = client.unregister_buffer(address)
                if rc != 0:
                    log.warning("unregister_buffer(%#x) returned %d", address, rc)
                if state.reader is not None:
                    state.reader.unregister(address)

    @contextlib.contextmanager
    def using(self, desc: Descriptors):
        """:meth:`use` for the block; then :meth:`release`, after ``uses.late`` where the
        block set it (``uses.late`` is then the release's future)."""
        used = self.use(desc)
        uses = Uses()
        try:
            yield uses
        finally:
            uses.late = self.release(used, uses.late)

    def use(self, desc: Descriptors) -> list[int]:
        """Register the memory of ``desc`` if needed, and count a user of its regions until
        :meth:`release` of what this returns. The spans of a raw (not vouched for)
        ``desc`` must lie inside registered regions: else ``ValueError``, nothing counted."""
        state = self.state
        with state.register_lock:
            registered = state.registered
            used, unregistered = [], state.stale  # one loop, no generator (the hot path)
            for address, nbytes in desc.regions:
                used.append(address)
                if registered.get(address) != nbytes:
                    unregistered = True
            if unregistered:
                self.register(desc.staging if desc.staging is not None else desc.regions)
            if not desc.vouched:  # raw addresses: each span inside one registered region
                check_spans(desc.keys, desc.ptrs, desc.sizes, registered.items())
            if not used:
                used = self._regions_touched(desc)
            in_use = state.in_use  # dict.get: a Counter's missing key is a Python call
            for address in used:
                in_use[address] = in_use.get(address, 0) + 1
        return used

    def release(self, used: list[int], late: Future | None) -> Future | None:
        """Stop using the regions ``used``: now, or once ``late`` (calls that timed out on
        them) completes; then the future of that release."""
        if late is not None and not late.done():
            released: Future = Future()
            late.add_done_callback(lambda _f: (self._free(used), released.set_result(None)))
            return released
        self._free(used)
        return None

    def _free(self, used: list[int]) -> None:
        in_use = self.state.in_use
        with self.state.register_lock:
            for address in used:
                left = in_use.get(address, 0) - 1
                if left > 0:
                    in_use[address] = left
                else:
                    in_use.pop(address, None)

    def _regions_touched(self, desc: Descriptors) -> list[int]:
        """The registered regions that spans of ``desc`` start in (for descriptors built
        from lists, which name no regions). The caller holds ``register_lock``."""
        if not desc.ptrs or not self.state.registered:
            return []
        starts = np.fromiter((p for row in desc.ptrs for p in row), dtype=np.uint64)
        return [a for a, n in self.state.registered.items()
                if bool(((starts >= a) & (starts < a + n)).any())]
