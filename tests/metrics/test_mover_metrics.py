"""A mover's evicts and prefetches through a real embedded master, metrics on: the bytes
exported are exactly the bytes moved (and the bytes land), statuses carry the store's raw
code, host and copy times are histograms, staging and path are reported."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove

ROW_BYTES = [4, 132, 576, 656, 1152, 4100]


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=st.sampled_from(ROW_BYTES), layers=st.integers(1, 3), pages=st.integers(1, 9),
       page_tokens=st.sampled_from([1, 4]))
def test_exported_bytes_are_the_bytes_moved(registry, store, keyspace, row, layers, pages,
                                            page_tokens):
    before = {(d, s): value(registry, "kvmove_bytes_total", direction=d, stage=s)
              for d, s in (("evict", "gather"), ("evict", "put"), ("prefetch", "get"),
                           ("prefetch", "scatter"))}
    slots = 2 * pages * page_tokens
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (layers, slots, row), dtype=torch.uint8)})
    src = torch.arange(pages * page_tokens).reshape(pages, page_tokens)
    dst = src + pages * page_tokens
    keys = keyspace(pages, tag=f"k{uuid.uuid4().hex[:8]}-")  # new keys for every example
    with kvmove.KVMover(kv, store, page_tokens=page_tokens, staging_slots=4,
                        path="staged") as mover:
        assert mover.evict(keys, src).wait(30) == [kvmove.Status.OK] * pages
        assert mover.prefetch(keys, dst).wait(30) == [kvmove.Status.OK] * pages
    whole = layers * row * pages * page_tokens
    table = kv.layer("kv", 0)
    assert torch.equal(table[dst.flatten()], table[src.flatten()])  # the bytes landed
    for (d, s), was in before.items():
        assert value(registry, "kvmove_bytes_total", direction=d, stage=s) - was == whole
        assert value(registry, "kvmove_stage_seconds_total", direction=d, stage=s) > 0


def test_statuses_by_status_and_raw_code(registry, store, keyspace):
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 32, 656), dtype=torch.uint8)})
    keys = keyspace(3)
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=4, path="staged") as mover:
        assert mover.evict(keys[:1], torch.arange(4).reshape(1, 4)).wait(30) == [
            kvmove.Status.OK]
        got = mover.prefetch(keys, torch.arange(12, 24).reshape(3, 4)).wait(30)
    assert got == [kvmove.Status.OK, kvmove.Status.MISS, kvmove.Status.MISS]
    assert value(registry, "kvmove_keys_total", direction="evict", status="OK", code="OK") == 1
    assert value(registry, "kvmove_keys_total", direction="prefetch", status="OK",
                 code="OK") == 1
    assert value(registry, "kvmove_keys_total", direction="prefetch", status="MISS",
                 code="OBJECT_NOT_FOUND") == 2
    # the bytes of the one key found, not of the three asked
    assert value(registry, "kvmove_bytes_total", direction="prefetch", stage="get") == (
        2 * 4 * 656)


def test_host_time_copy_time_staging_and_path(registry, store, keyspace):
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 64, 132), dtype=torch.uint8)})
    with kvmove.KVMover(kv, store, page_tokens=4, staging_slots=8, path="staged") as mover:
        assert value(registry, "kvmove_staging_slots") == 8
        assert value(registry, "kvmove_movers_total", direction="evict", path="staged") == 1
        held = mover.staging.alloc(3)  # slots in use, as a transfer in flight holds them
        assert value(registry, "kvmove_staging_slots_in_use") == 3
        mover.staging.free(held)
        for i in range(5):
            keys = keyspace(2, tag=f"r{i}")
            mover.evict(keys, torch.arange(8).reshape(2, 4)).wait(30)
            mover.prefetch(keys, torch.arange(8, 16).reshape(2, 4)).wait(30)
        assert value(registry, "kvmove_staging_slots_in_use") == 0
    for op in ("evict", "prefetch"):
        assert value(registry, "kvmove_call_host_seconds_count", op=op) == 5
        assert 0 < value(registry, "kvmove_call_host_seconds_sum", op=op) < 5
        assert value(registry, "kvmove_call_host_seconds_bucket", op=op, le="+Inf") == 5
    for stage in ("gather", "scatter"):
        assert value(registry, "kvmove_copy_seconds_count", stage=stage) == 5
    assert value(registry, "kvmove_results_total", direction="evict") == 5


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.interpreter
def test_triton_copies_report_their_programs(registry):
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (3, 32, 132), dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    kvmove.gather(kv, staging, torch.arange(8).reshape(2, 4), torch.tensor([0, 1]),
                  backend="triton")
    assert value(registry, "kvmove_copy_max_programs_count") >= 1
    # the interpreter's config caps the grid at 4 programs
    assert value(registry, "kvmove_copy_max_programs_bucket", le="4.0") == value(
        registry, "kvmove_copy_max_programs_count")
    assert value(registry, "kvmove_copy_max_programs_bucket", le="2.0") == 0
