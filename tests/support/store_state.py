"""What a :class:`kvmove.MooncakeStore` has registered, read from its private state (the
store keeps no public accessor for it: only the tests ask), and a Mooncake client wrapper
that slows or fails its exists checks, puts and gets (:func:`swap_client` puts one in
place)."""

from __future__ import annotations

import threading
import time

CHECK, PUT, GET = "batch_is_exist", "batch_put_from_multi_buffers", "batch_get_into_multi_buffers"


def registered_regions(store) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` regions registered with the store's client now."""
    with store._state.register_lock:
        return list(store._state.registered.items())


def regions_in_use(store) -> dict[int, int]:
    """``{address: calls}``: the registered regions that put/get calls are using now."""
    with store._state.register_lock:
        return {a: n for a, n in store._state.in_use.items() if n}


def calls_in_flight(store) -> int:
    """How many store calls (and begun puts) hold a client now."""
    with store._clients.lock:
        return store._clients.in_flight


def swap_client(store, make):
    """Put ``make(client)`` in place of the store's client (a wrapper that forwards to it),
    with the same span budget; returns the wrapper."""
    clients = store._clients
    real = clients.state.client
    wrapper = make(real)
    with clients.lock:
        clients.budgets[id(wrapper)] = clients.budgets[id(real)]
        clients.state.client = wrapper
    return wrapper


class SlowClient:
    """A Mooncake client that forwards every call; it records which thread made each exists
    check, put and get, delays them by ``delay[name]`` seconds first, and makes those named
    in ``fail`` raise (after their delay)."""

    def __init__(self, real):
        self._real = real
        self.delay: dict[str, float] = {}
        self.fail: set[str] = set()
        self.calls: list[tuple[str, int]] = []
        self.returned: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _run(self, name: str, *args):
        with self._lock:
            self.calls.append((name, threading.get_ident()))
        time.sleep(self.delay.get(name, 0.0))
        if name in self.fail:
            raise RuntimeError(f"{name} failed")
        try:
            return getattr(self._real, name)(*args)
        finally:
            with self._lock:
                self.returned.append(name)

    def batch_is_exist(self, keys):
        return self._run(CHECK, keys)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):  # a data call
        return self._run(PUT, keys, ptrs, sizes, config)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):  # a data call
        return self._run(GET, keys, ptrs, sizes)

    def threads(self, name: str) -> list[int]:
        """The threads (idents) that made the calls of ``name``, in order."""
        with self._lock:
            return [thread for n, thread in self.calls if n == name]

    def names(self) -> list[str]:
        with self._lock:
            return [name for name, _ in self.calls]
