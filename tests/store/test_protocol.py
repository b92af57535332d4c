"""Both stores implement :class:`kvmove.store.protocol.Store`: ``MooncakeStore`` and the tests'
``MemoryStore`` pass ``isinstance``, and each method of the protocol takes, in both, every
parameter the protocol names, the same way (keyword-only stays keyword-only) and with the
same default, so a caller typed against the protocol never needs to probe a store."""

from __future__ import annotations

import inspect

import pytest

import kvmove
from kvmove.store.protocol import PendingStorePut, Store
from tests.support.memory_store import MemoryStore

IMPLEMENTATIONS = [kvmove.MooncakeStore, MemoryStore]


def protocol_members(protocol) -> dict[str, object]:
    """The public methods and properties a protocol class declares."""
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def test_the_protocol_names_what_the_mover_needs():
    assert set(protocol_members(Store)) == {
        "transport", "address", "register", "unregister", "put", "begin_put", "get",
        "exists", "remove", "close"}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(n for n, v in protocol_members(Store).items()
                                        if callable(v)))
def test_each_method_takes_the_protocols_parameters(impl, name):
    wanted = inspect.signature(getattr(Store, name)).parameters
    method = getattr(impl, name, None)
    assert callable(method), f"{impl.__name__} has no {name}()"
    have = inspect.signature(method).parameters
    for param in list(wanted.values())[1:]:  # after self
        assert param.name in have, f"{impl.__name__}.{name}() lacks {param.name!r}"
        got = have[param.name]
        if param.kind is inspect.Parameter.KEYWORD_ONLY:
            assert got.kind in (inspect.Parameter.KEYWORD_ONLY,
                                inspect.Parameter.POSITIONAL_OR_KEYWORD), (
                f"{impl.__name__}.{name}(): {param.name!r} is not a keyword parameter")
        elif param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert got.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (
                f"{impl.__name__}.{name}(): {param.name!r} is not positional")
        assert got.default == param.default, (
            f"{impl.__name__}.{name}(): {param.name!r} defaults to {got.default!r}, "
            f"the protocol to {param.default!r}")
    extra = [p.name for p in list(have.values())[1:] if p.name not in wanted
             and p.default is inspect.Parameter.empty
             and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    assert not extra, f"{impl.__name__}.{name}() needs arguments the protocol lacks: {extra}"


def test_the_memory_store_is_a_store():
    with MemoryStore() as store:
        assert isinstance(store, Store)
        with store.begin_put(["k"]) as pending:
            assert isinstance(pending, PendingStorePut)


@pytest.mark.store
def test_the_mooncake_store_is_a_store(store):
    assert isinstance(store, Store)
    assert store.transport in ("tcp", "rdma") and store.address
    with store.begin_put(["protocol-check"]) as pending:
        assert isinstance(pending, PendingStorePut)


def test_an_object_missing_a_method_is_not_a_store():
    class Partial:
        transport, address = None, "nowhere"

        def put(self, desc, *, detect_exists=None, until_returned=False): ...

    assert not isinstance(Partial(), Store)
