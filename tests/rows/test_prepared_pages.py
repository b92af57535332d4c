"""Prepared page indices (kvmove.prepare_pages): the same bytes as the one-shot gather and
scatter on every backend, call after call; the values are a snapshot (the caller may
refill its buffers); checks run before anything is written, once per direction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from tests.support.caches import ROW_BYTES

pytestmark = pytest.mark.usefixtures("triton_interpreter")
SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


def cache_of(kind: str, layers: int, slots: int, row_bytes: int, seed: int) -> kvmove.KVCache:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (layers, slots, row_bytes), dtype=torch.uint8, generator=g)
    return kvmove.KVCache({"kv": data if kind == "stacked" else list(data.clone())})


def layers_of(kv: kvmove.KVCache) -> torch.Tensor:
    return torch.stack([kv.layer("kv", i) for i in range(kv.num_layers("kv"))])


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
@SETTINGS
@given(data=st.data(), row_bytes=st.sampled_from(ROW_BYTES), page_tokens=st.sampled_from([1, 16]),
       kind=st.sampled_from(["stacked", "per_layer"]), scattered=st.booleans())
def test_prepared_pages_move_what_the_one_shot_calls_move(backend, data, row_bytes,
                                                          page_tokens, kind, scattered):
    layers, kv_slots = 2, 96
    n = data.draw(st.integers(1, 4))
    kv = cache_of(kind, layers, kv_slots, row_bytes, seed=n)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    if scattered:
        rows = torch.randperm(kv_slots, generator=g)[:n * page_tokens]
    else:
        rows = (torch.randperm(kv_slots // page_tokens, generator=g)[:n, None] * page_tokens
                + torch.arange(page_tokens)).reshape(-1)
    token_pages = rows.clone().reshape(n, page_tokens)  # the caller's buffers
    slots = torch.randperm(6, generator=g)[:n]
    kept_slots = slots.clone()
    one_shot = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens)
    reused = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens)
    one_shot.tensor("kv").zero_()
    kvmove.gather(kv, one_shot, token_pages, slots, backend=backend)
    pages = kvmove.prepare_pages(kv, reused, token_pages, slots, backend=backend)
    assert isinstance(pages, kvmove.PreparedPages) and len(pages) == n
    token_pages.fill_(-1)  # the caller refills its buffers: the snapshot is unchanged
    slots.fill_(0)
    for _ in range(2):  # planned once, run twice
        reused.tensor("kv").zero_()
        assert int(pages.gather()) == 0
        assert torch.equal(reused.tensor("kv"), one_shot.tensor("kv"))
    # Scatter back into a zeroed cache: each named row holds the source row, others zero.
    other = cache_of(kind, layers, kv_slots, row_bytes, seed=0)
    for i in range(layers):
        other.layer("kv", i).zero_()
    back = kvmove.prepare_pages(other, reused, rows.reshape(n, page_tokens), kept_slots,
                                backend=backend)
    for layer in (0, None):
        assert int(back.scatter(layers=layer)) == 0
    expect = torch.zeros_like(layers_of(kv))
    expect[:, rows] = layers_of(kv)[:, rows]
    wrong = (layers_of(other) != expect).any(dim=-1).nonzero().tolist()
    assert not wrong, f"(layer, row) wrong after the scatter: {wrong[:8]}"
    one_shot.close()
    reused.close()


def test_prepared_pages_check_before_writing_once_per_direction():
    kv = cache_of("stacked", 2, 64, 132, seed=3)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=2)
    with pytest.raises(ValueError, match="tokens per page"):
        kvmove.prepare_pages(kv, staging, [[1, 2, 3]], [0])
    with pytest.raises(TypeError, match="token_pages"):
        kvmove.prepare_pages(kv, staging, torch.zeros(1, 2), [0])
    before = staging.tensor("kv").clone()
    bad = kvmove.prepare_pages(kv, staging, [[1, 64]], [0])
    with pytest.raises(IndexError, match="token_pages"):
        bad.gather()
    assert torch.equal(staging.tensor("kv"), before)
    # A KV row read twice is a fine gather, but a scatter would write it twice.
    twice = kvmove.prepare_pages(kv, staging, [[5, 6], [6, 7]], [0, 1])
    assert int(twice.gather()) == 0
    with pytest.raises(ValueError, match="token_pages"):
        twice.scatter()
    # Unchecked: out-of-range rows are skipped and counted on every call.
    loose = kvmove.prepare_pages(kv, staging, [[1, 64]], [2], check=False)
    assert int(loose.gather()) == 1 and int(loose.gather()) == 1
    assert torch.equal(staging.tensor("kv")[:, 2, :132],
                       torch.stack([kv.layer("kv", i)[1] for i in range(2)]))
    staging.close()
