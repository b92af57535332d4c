"""Random page batches, both directions, every (pool, layout) both backends serve: whatever
pages SGLang's Mooncake backend stores, kvmove's backend reads into whatever free pages with
the bytes exact and nothing else touched (and the reverse)."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integrations.sglang.conftest import (
    kvmove_backend,
    mha_pool,
    mla_pool,
    page_data,
    sglang_backend,
    storage_config,
)

PAGE, PAGES = 2, 24
CASES = [("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct"),
         ("mha", "page_first"), ("mha", "page_first_direct")]


@pytest.fixture(scope="module")
def pairs(master):
    """Per case: (SGLang's backend, kvmove's backend, their pools), created once."""
    made, backends = {}, []
    for kind, layout in CASES:
        model = f"org/random-{uuid.uuid4().hex[:8]}"
        build = mla_pool if kind == "mla" else mha_pool
        ends = []
        for factory, seed in ((sglang_backend, 1), (kvmove_backend, 2)):
            backend = factory(storage_config(mla=kind == "mla",
                                             page_first=layout != "layer_first", model=model))
            pool = build(layout, page_size=PAGE, tokens=PAGES * PAGE, seed=seed)
            backend.register_mem_pool_host(pool)
            backends.append(backend)
            ends.append((backend, pool))
        made[(kind, layout)] = ends
    yield made
    for backend in backends:
        backend.close()


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), sglang_writes=st.booleans(), data=st.data())
def test_random_batches_round_trip(pairs, case, sglang_writes, data):
    (sg, sg_pool), (ours, our_pool) = pairs[case]
    (writer, src), (reader, dst) = ((sg, sg_pool), (ours, our_pool)) if sglang_writes else \
        ((ours, our_pool), (sg, sg_pool))
    n = data.draw(st.integers(1, 6))
    src_pages = data.draw(st.lists(st.integers(0, PAGES - 1), min_size=n, max_size=n,
                                   unique=True))
    dst_pages = data.draw(st.lists(st.integers(0, PAGES - 1), min_size=n, max_size=n,
                                   unique=True))
    keys = [uuid.uuid4().hex for _ in range(n)]
    before = {p: page_data(dst, p) for p in range(PAGES)}
    assert writer.batch_set_v1(keys, indices(src_pages)) == [True] * n
    assert reader.batch_exists(keys) == n
    assert reader.batch_get_v1(keys, indices(dst_pages)) == [True] * n
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert page_data(dst, d) == page_data(src, s)
    for p in set(range(PAGES)) - set(dst_pages):
        assert page_data(dst, p) == before[p]
