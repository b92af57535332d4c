"""Processes and pools for the direct-transfer tests: one receiver process (a guarded
pool per host layout, hybrid buffers, more receivers as tests need them, a second sender)
and one to stop or kill, started once for the session; the sender under test lives in the
test process."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

import kvmove
from tests.support.direct_peers import Peer
from tests.support.direct_pools import GUARD, GUARD_BYTE, LAYOUTS, apply_send, kv_layers

PAGE_TOKENS = 4
PAGES = 16
HYBRID = {"kv": [4, 656], "idx": [2, 132]}  # DSA-like rows; the indexer has fewer layers
KV_SLOTS = 256


def spec(layout: str, buffers=None, pages: int = PAGES) -> dict:
    return {"layout": layout, "page_tokens": PAGE_TOKENS, "pages": pages,
            "buffers": buffers or HYBRID}


class Remote:
    """A receiver in another process: its handle, its bytes (guard bands included) and
    the bytes a test expects there."""

    def __init__(self, peer: Peer, spec: dict, seed: int):
        self.peer, self.spec = peer, spec
        answer = peer.call("receiver", spec=spec, seed=seed)
        self.key, self.handle = answer["id"], answer["handle"]

    def read(self) -> dict[str, torch.Tensor]:
        raw = self.peer.call("read", key=self.key)
        return {n: torch.frombuffer(bytearray(b), dtype=torch.uint8) for n, b in raw.items()}

    def views(self, wholes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from tests.support.direct_pools import pool_shape

        out = {}
        for name, (layers, row) in self.spec["buffers"].items():
            shape = pool_shape(self.spec["layout"], layers, row, self.spec["pages"],
                               self.spec["page_tokens"])
            out[name] = wholes[name][GUARD:GUARD + int(np.prod(shape))].view(shape)
        return out

    def expect(self, kv, token_pages, dst_pages, layers=None, ok=None) -> dict:
        """The bytes the receiver holds now, with a send of these pages applied."""
        wholes = self.read()
        apply_send(self.views(wholes), kv, self.spec["layout"], self.spec["page_tokens"],
                   token_pages, dst_pages, layers, ok)
        return wholes

    def assert_holds(self, expected: dict) -> None:
        got = self.read()
        for name, want in expected.items():
            assert bool((got[name][:GUARD] == GUARD_BYTE).all()), f"{name}: low guard changed"
            assert bool((got[name][-GUARD:] == GUARD_BYTE).all()), f"{name}: high guard changed"
            diff = torch.nonzero(got[name] != want)
            assert diff.numel() == 0, f"{name}: {diff.numel()} bytes differ, first at " \
                                      f"{int(diff[0]) - GUARD} from the pool's start"

    def close(self) -> None:
        self.peer.call("close", key=self.key)


@pytest.fixture(scope="session")
def peers():
    """A process (receivers, a second sender) and a second one to stop or kill
    (``victim``), started together: they start up while the first tests run."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    started = [Peer() for _ in range(2)]
    yield started
    for p in started:
        p.ask_to_exit()
    for p in started:
        p.close()


@pytest.fixture
def victim(peers):
    """A process of its own for a test to SIGSTOP or SIGKILL: the second peer while it
    lives (a stopped one is continued after its test), else a new one."""
    if not peers[1].proc.is_alive():
        peers[1] = Peer()
    yield peers[1]
    if peers[1].proc.is_alive():
        peers[1].signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def receivers(peers):
    """A receiver per host layout, hybrid buffers, in the first process."""
    made = {layout: Remote(peers[0], spec(layout), seed=i) for i, layout in enumerate(LAYOUTS)}
    yield made
    for r in made.values():
        r.close()


@pytest.fixture(scope="session")
def kv_bytes():
    return kv_layers(HYBRID, KV_SLOTS, seed=7)


@pytest.fixture(scope="session")
def sender(kv_bytes):
    """The sender under test, in this process."""
    tx = kvmove.PageSender(kvmove.KVCache(kv_bytes), page_tokens=PAGE_TOKENS,
                           staging_slots=8, hostname="127.0.0.1")
    yield tx
    tx.close()
