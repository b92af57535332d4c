"""The GPU tests' in-memory store (:mod:`tests.support.memory_store`) answers one sequence of
calls exactly as a real store on a ``mooncake_master`` does: statuses per key, the bytes
read back, and refusing to unregister memory a call is using. Were it to drift, the GPU
tests of the mover would test against a store that does not exist."""

from __future__ import annotations

import pytest
import torch

import kvmove
from kvmove.errors import StoreError
from tests.support.memory_store import MemoryStore

pytestmark = pytest.mark.store


def run_sequence(store, keys: list[str]) -> list:
    """Every answer of a put/get/exists/remove sequence, bytes included."""
    g = torch.Generator().manual_seed(5)
    kv = kvmove.KVCache({"kv": torch.zeros(2, 32, 132, dtype=torch.uint8),
                         "ix": torch.zeros(1, 32, 4, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=4)
    for name in staging.buffer_names:
        t = staging.tensor(name)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    out = []
    store.register(staging)
    try:
        a, b, missing = keys
        out.append(list(store.put(kvmove.describe(staging, [0, 1], [a, b]))))
        out.append(list(store.put(kvmove.describe(staging, [2], [a]))))  # stored: kept
        sent = [staging.tensor(n)[:, :2].clone() for n in staging.buffer_names]
        got = store.get(kvmove.describe(staging, [3, 4], [a, b]))
        out.append(list(got))
        out.append(all(torch.equal(staging.tensor(n)[:, 3:5], s)
                       for n, s in zip(staging.buffer_names, sent, strict=True)))
        out.append(list(store.get(kvmove.describe(staging, [5], [missing]))))
        out.append(list(store.get(kvmove.describe(staging, [5], [a], valid_tokens=3))))
        out.append(list(store.exists([a, missing, b])))
        out.append(list(store.remove([b, missing], force=True)))
        out.append(list(store.exists([a, b])))
    finally:
        store.unregister(staging)
    return out


def test_the_memory_store_answers_as_a_real_store(store, keyspace):
    real = run_sequence(store, keyspace(3, "real"))
    memory = run_sequence(MemoryStore(), keyspace(3, "memory"))
    assert memory == real
    ok, exists, miss = kvmove.Status.OK, kvmove.Status.EXISTS, kvmove.Status.MISS
    assert real == [[ok, ok], [exists], [ok, ok], True, [miss],
                    [kvmove.Status.SIZE_MISMATCH], [True, False, True], [ok, miss],
                    [True, False]]


def test_the_memory_store_refuses_to_unregister_memory_in_use():
    store = MemoryStore()
    kv = kvmove.KVCache({"kv": torch.zeros(1, 8, 4, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4)
    store.register(staging)
    desc = kvmove.describe(staging, [0], ["k"])
    store._use(desc, +1)  # a put in flight
    with pytest.raises(StoreError, match="in flight"):
        store.unregister(staging)
    store._use(desc, -1)
    store.unregister(staging)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.put(desc)
