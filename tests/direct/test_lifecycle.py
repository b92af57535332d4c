"""A sender's life around failures and close, with a receiver in this process and the
sender's writes slowed or reshaped (``Engine.write`` patched): closing during a send larger
than the staging returns its Transfer; the staging is freed once a write left running at
close ends; a ``call_timeout`` Mooncake's own write timeout could overrun is refused; a
page reported ``FAILED`` is not written afterwards."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvmove
from kvmove import Status
from kvmove.direct.sender import CALL_TIMEOUT_MARGIN_S, mooncake_write_timeout
from kvmove.memory import host_memory
from kvmove.status import NOT_SENT, WRITE_TIMEOUT
from kvmove.store.transfer_engine import Engine
from tests.support.direct_pools import apply_send, kv_layers, make_pool

P = 4
BUFFERS = {"kv": [2, 656]}


@pytest.fixture
def pool():
    """A layer_first receiver in this process: ``(receiver, its views)``."""
    made, _, views = make_pool({"layout": "layer_first", "page_tokens": P, "pages": 8,
                                "buffers": BUFFERS}, seed=5)
    rx = kvmove.PageReceiver(made, hostname="127.0.0.1")
    yield rx, views
    rx.close()


@pytest.fixture
def kv():
    return kv_layers(BUFFERS, 64, seed=3)


def sender(kv, **kw) -> kvmove.PageSender:
    return kvmove.PageSender(kvmove.KVCache(kv), page_tokens=P, staging_slots=2,
                             hostname="127.0.0.1", **kw)


def pages(n: int) -> torch.Tensor:
    return torch.arange(n * P).reshape(n, P)


def slow_writes(monkeypatch, seconds: float, rc: int | None = None) -> threading.Event:
    """Writes of data take ``seconds`` (then land; return ``rc`` if given). The event is
    set when the first one starts."""
    real, started = Engine.write, threading.Event()

    def write(self, peer, srcs, dsts, lengths):
        if lengths:
            started.set()
            time.sleep(seconds)
        got = real(self, peer, srcs, dsts, lengths)
        return got if rc is None or not lengths else rc

    monkeypatch.setattr(Engine, "write", write)
    return started


def test_closing_during_a_send_larger_than_the_staging_returns_its_transfer(
        monkeypatch, pool, kv):
    rx, views = pool
    before = views["kv"].clone()
    writing = slow_writes(monkeypatch, 1.0)
    tx = sender(kv)
    out = {}

    def send():
        try:
            out["transfer"] = tx.send(rx.handle, pages(4), [0, 1, 2, 3])
        except Exception as e:  # the test reports it
            out["error"] = e

    thread = threading.Thread(target=send)
    thread.start()
    assert writing.wait(30)  # piece 1 (pages 0, 1) is being written, piece 2 waits for slots
    tx.close()
    assert not thread.is_alive(), "close() returned before the send in progress"
    thread.join()
    assert "error" not in out, f"send() raised {out.get('error')!r} after pages were written"
    result = out["transfer"].result(0)
    assert result.statuses == [Status.OK] * 2 + [Status.FAILED] * 2
    assert result.codes == [0, 0, NOT_SENT, NOT_SENT]
    expected = {"kv": before.clone()}
    apply_send(expected, kv, "layer_first", P, pages(2), [0, 1])
    assert torch.equal(views["kv"], expected["kv"])  # pages 2, 3 as they were


def test_no_staging_is_made_after_close(kv):
    tx = sender(kv)
    tx.close()
    # A send racing close() must not add staging while close() frees what there is.
    with pytest.raises(kvmove.KVMoveError, match="closed"):
        tx._staging_for("page_first")
    assert "page_first" not in tx._staged


def test_the_staging_is_freed_when_a_write_left_running_at_close_ends(monkeypatch, pool,
                                                                      kv):
    registered = {}

    class Pinning:  # stands for cudaHostRegister on this CPU-only machine
        def register(self, address, nbytes):
            registered[address] = nbytes
            return address

        def unregister(self, address):
            registered.pop(address)

    monkeypatch.setattr(host_memory, "pinning_for", lambda device: Pinning())
    rx, _ = pool
    slow_writes(monkeypatch, 2.0)
    tx = sender(kv)
    # The write overruns the watchdog (as if Mooncake overran its own timeout): close()
    # leaves it to its thread.
    tx._watchdog.timeout = 0.5
    assert registered
    transfer = tx.send(rx.handle, pages(2), [0, 1])
    time.sleep(1.0)
    tx.close()
    assert registered  # the write still reads the staging
    transfer.wait(30)
    deadline = time.monotonic() + 10
    while registered and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not registered, "the staging stays pinned after the write left at close ended"


def test_a_call_timeout_mooncake_could_overrun_is_refused(monkeypatch, kv):
    assert mooncake_write_timeout({}) == 5  # kvmove's default
    assert [mooncake_write_timeout({"MC_TRANSFER_TIMEOUT": v})
            for v in ("2", " 12", "7.9", "x", "")] == [5, 12, 7, 5, 5]  # as Mooncake reads it
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    with pytest.raises(ValueError, match=r"call_timeout \(0\.5 s\).*\(5 s: kvmove's default"):
        sender(kv, call_timeout=0.5)
    with pytest.raises(ValueError, match=r"call_timeout \(5\.5 s\)"):
        sender(kv, call_timeout=5.5)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "20")
    with pytest.raises(ValueError,
                       match=r"call_timeout \(8 s\).*\(20 s: MC_TRANSFER_TIMEOUT='20'"):
        sender(kv)
    sender(kv, call_timeout=20 + CALL_TIMEOUT_MARGIN_S).close()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "1")  # Mooncake makes it 5
    with pytest.raises(ValueError, match=r"\(5 s: MC_TRANSFER_TIMEOUT='1'"):
        sender(kv, call_timeout=3)
    sender(kv, call_timeout=5 + CALL_TIMEOUT_MARGIN_S).close()


def lands_after_the_call(monkeypatch, delay: float) -> None:
    """Writes of data fail at once (-1) but their bytes land ``delay`` s later, unless the
    engine is destroyed first: Mooncake does not cancel a failed write."""
    real_write, real_close = Engine.write, Engine.close
    late: dict[int, threading.Thread] = {}

    def write(self, peer, srcs, dsts, lengths):
        if not lengths:
            return real_write(self, peer, srcs, dsts, lengths)
        thread = threading.Thread(
            target=lambda: (time.sleep(delay), real_write(self, peer, srcs, dsts, lengths)))
        late[id(self)] = thread
        thread.start()
        return -1

    def close(self):
        thread = late.pop(id(self), None)
        if thread is not None:
            thread.join()  # destroying the engine ends its writes (here: waits for them)
        real_close(self)

    monkeypatch.setattr(Engine, "write", write)
    monkeypatch.setattr(Engine, "close", close)


@pytest.mark.parametrize("how", ["overran_the_call_timeout", "lands_after_the_call"])
def test_a_page_reported_failed_is_not_written_afterwards(monkeypatch, pool, kv, how):
    rx, views = pool
    tx = sender(kv)
    if how == "overran_the_call_timeout":
        # Mooncake overran its own timeout (it cannot, by the check at construction, unless
        # starved): the watchdog times out at 0.5 s, the bytes land at 1.5 s, then -1.
        slow_writes(monkeypatch, 1.5, rc=-1)
        tx._watchdog.timeout = 0.5
        code, lands = WRITE_TIMEOUT, 1.5
    else:
        lands_after_the_call(monkeypatch, 0.5)
        code, lands = -1, 0.5
    try:
        t0 = time.monotonic()
        result = tx.send(rx.handle, pages(2), [0, 1]).result(30)
        assert result.statuses == [Status.FAILED] * 2
        assert result.codes == [code] * 2
        # The decode side reuses the FAILED pages at once.
        views["kv"][:, 0:2 * P] = 7
        time.sleep(max(0.0, t0 + lands + 1.0 - time.monotonic()))
        assert bool((views["kv"][:, 0:2 * P] == 7).all()), \
            "bytes landed in pages after they were reported FAILED"
    finally:
        tx.close()
