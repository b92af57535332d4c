"""What a :class:`kvmove.MooncakeStore` has registered, read from its private state (the
store keeps no public accessor for it: only the tests ask)."""

from __future__ import annotations


def registered_regions(store) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` regions registered with the store's client now."""
    with store._register_lock:
        return list(store._state.registered.items())


def regions_in_use(store) -> dict[int, int]:
    """``{address: calls}``: the registered regions that put/get calls are using now."""
    with store._register_lock:
        return {a: n for a, n in store._state.in_use.items() if n}


def calls_in_flight(store) -> int:
    """How many store calls (and begun puts) hold a client now."""
    with store._lock:
        return store._in_flight


def swap_client(store, make):
    """Put ``make(client)`` in place of the store's client (a wrapper that forwards to it),
    with the same span budget; returns the wrapper."""
    real = store._client
    wrapper = make(real)
    with store._lock:
        store._budgets[id(wrapper)] = store._budgets[id(real)]
        store._client = store._state.client = wrapper
    return wrapper
