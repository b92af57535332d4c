"""The two-hop (copy-engine) path on the CPU, where its ring is host memory and its spans are
memmoves: the same bytes as the torch backend for hypothesis-generated caches, fragmented
slots, padding, layer subsets and rings small enough to force many chunks; out-of-range
rows skipped and counted; spans merged only where rows are adjacent."""

from __future__ import annotations

import ctypes
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.copy_engine.device_ring import ENV_RING_BYTES, ring_capacity, ring_for
from kvmove.rows.copy_engine.span_copies import copy_span_grid, copy_spans
from kvmove.rows.copy_engine.two_hop import copy_rows_two_hop, span_grid
from kvmove.rows.prepared import resolve_backend
from tests.support.caches import (
    assert_same,
    buffer_specs,
    build_cache,
    fill_random,
    snapshot,
)

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


pytestmark = pytest.mark.usefixtures("triton_interpreter")


@st.composite
def pages_and_slots(draw, kv_slots, staging_slots, page_tokens):
    """Scattered KV rows with -1 padding; distinct staging slots in any order (fragmented)."""
    n = draw(st.integers(1, staging_slots))
    token = st.one_of(st.integers(0, kv_slots - 1), st.just(-1))
    pages = draw(st.lists(st.lists(token, min_size=page_tokens, max_size=page_tokens),
                          min_size=n, max_size=n))
    slots = draw(st.permutations(range(staging_slots)))[:n]
    if draw(st.booleans()):
        slots = sorted(slots)  # contiguous runs: one span per layer where slots are adjacent
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(pages, dtype=dtype), torch.tensor(slots, dtype=dtype)


ring_sizes = st.sampled_from(["", "1", "700", "5000", "100000"])  # "" = the default ring


@SETTINGS
@given(data=st.data(), specs=buffer_specs(), page_tokens=st.sampled_from([1, 2, 3, 16, 64]),
       kv_slots=st.integers(4, 40), ring=ring_sizes)
def test_gather_matches_torch_backend(data, specs, page_tokens, kv_slots, ring):
    kv = build_cache(specs, kv_slots, seed=data.draw(st.integers(0, 1000)))
    staging_slots = data.draw(st.integers(1, 6))
    token_pages, slots = data.draw(pages_and_slots(kv_slots, staging_slots, page_tokens))
    results = []
    with mock.patch.dict(os.environ, {ENV_RING_BYTES: ring}):
        for backend in ("torch", "two_hop"):
            staging = kvmove.StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens)
            fill_random(staging, seed=3)
            errors = kvmove.gather(kv, staging, token_pages, slots, backend=backend)
            assert int(errors) == 0
            results.append(snapshot(staging))
    assert_same(results[0], results[1])


@SETTINGS
@given(data=st.data(), specs=buffer_specs(), page_tokens=st.sampled_from([1, 4, 16]),
       kv_slots=st.integers(4, 40), ring=ring_sizes)
def test_scatter_matches_torch_backend(data, specs, page_tokens, kv_slots, ring):
    src = build_cache(specs, kv_slots, seed=5)
    staging_slots = data.draw(st.integers(1, 5))
    staging = kvmove.StagingBuffer(src, num_slots=staging_slots, page_tokens=page_tokens)
    fill_random(staging, seed=data.draw(st.integers(0, 100)))
    n = data.draw(st.integers(1, staging_slots))
    slots = torch.tensor(data.draw(st.permutations(range(staging_slots)))[:n])
    # Destination KV rows: distinct, with -1 padding.
    perm = data.draw(st.permutations(range(kv_slots)))
    flat = [perm[i] if i < kv_slots and data.draw(st.integers(0, 4)) else -1
            for i in range(n * page_tokens)]
    token_pages = torch.tensor(flat).reshape(n, page_tokens)
    layers = data.draw(st.one_of(st.none(), st.integers(0, src.max_layers - 1)))
    results = []
    with mock.patch.dict(os.environ, {ENV_RING_BYTES: ring}):
        for backend in ("torch", "two_hop"):
            kv = build_cache(specs, kv_slots, seed=6)
            errors = kvmove.scatter(staging, slots, kv, token_pages, layers=layers,
                                    backend=backend)
            assert int(errors) == 0
            results.append(snapshot(kv))
    assert_same(results[0], results[1])


@pytest.mark.interpreter
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_triton_interpreter_as_the_device_copy(direction, monkeypatch):
    """The two-hop path with the Triton kernel as its device-side copy, as on CUDA."""
    monkeypatch.setenv(ENV_RING_BYTES, "4000")  # several chunks
    kv = build_cache([("kv", 3, 656, torch.uint8, 2, False)], 32, seed=8)
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=4)
    fill_random(staging, seed=9)
    kv_rows = torch.tensor([3, 4, 5, 6, 31, 30, -1, 2, 9, 10, 11, 12, 0, 1, 17, 18])
    staging_rows = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23, 4, 5, 6, 7])
    src_pool, dst_pool = ((kv, staging) if direction == "gather" else (staging, kv))
    s, d = (kv_rows, staging_rows) if direction == "gather" else (staging_rows, kv_rows)
    reference = build_cache([("kv", 3, 656, torch.uint8, 2, False)], 32, seed=8)
    ref_staging = kvmove.StagingBuffer(reference, num_slots=6, page_tokens=4)
    fill_random(ref_staging, seed=9)
    ref_src, ref_dst = ((reference, ref_staging) if direction == "gather"
                        else (ref_staging, reference))
    kvmove.copy_rows(ref_src, s, ref_dst, d, backend="torch")
    copy_rows_two_hop(src_pool.row_pool.buffers["kv"], dst_pool.row_pool.buffers["kv"],
                      [0, 1, 2], s, d, None, direction=direction, page_tokens=4, inner="triton")
    assert_same(snapshot(dst_pool), snapshot(ref_dst))


HOST_ROWS = np.array([4, 5, 6, 9, 10, 2])  # runs 4-6, 9-10 and 2


def staging_and_ring(layers: int):
    """The rows of a 4-slot, 4-token staging buffer of 8-byte rows, and its KV's ring."""
    kv = build_cache([("kv", layers, 8, torch.uint8, 0, True)], 16)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    return staging.row_pool.buffers["kv"], ring_for(kv.row_pool.buffers["kv"]).rows


def test_spans_merge_adjacent_rows_only():
    host, ring = staging_and_ring(2)
    rows = HOST_ROWS
    host_addr, ring_addr, sizes, _, _, height = span_grid(host, rows, ring, [1])
    assert height == 1
    base_h, base_r = host.device_addresses[1], ring.device_addresses[1]
    assert (host_addr - base_h).tolist() == [4 * 8, 9 * 8, 2 * 8]
    assert (ring_addr - base_r).tolist() == [0, 3 * 8, 5 * 8]
    assert sizes.tolist() == [3 * 8, 2 * 8, 8]
    # Rows with a pitch larger than the row are never merged.
    padded = build_cache([("kv", 1, 8, torch.uint8, 4, False)], 16).row_pool.buffers["kv"]
    _, _, sizes, _, _, _ = span_grid(padded, np.array([1, 2, 3]), ring, [0])
    assert sizes.tolist() == [8, 8, 8]
    empty = span_grid(host, np.array([], dtype=np.int64), ring, [0, 1])
    assert all(len(x) == 0 for x in empty[:3])


def test_span_grid_repeats_one_layers_spans_at_the_layer_pitch():
    host, ring = staging_and_ring(4)
    rows = HOST_ROWS
    host_addr, ring_addr, sizes, host_pitch, ring_pitch, height = span_grid(
        host, rows, ring, [0, 1, 2, 3])
    assert height == 4 and len(sizes) == 3  # three runs, not twelve spans
    assert host_pitch == host.device_addresses[1] - host.device_addresses[0] == 16 * 8
    assert ring_pitch == ring.device_addresses[1] - ring.device_addresses[0]
    assert (host_addr - host.device_addresses[0]).tolist() == [4 * 8, 9 * 8, 2 * 8]
    assert (ring_addr - ring.device_addresses[0]).tolist() == [0, 3 * 8, 5 * 8]
    # Unevenly spaced layers: every span listed.
    host_addr, _, sizes, _, _, height = span_grid(host, rows, ring, [0, 1, 3])
    assert height == 1 and len(sizes) == 9
    assert (host_addr[6:] - host.device_addresses[3]).tolist() == [4 * 8, 9 * 8, 2 * 8]


def test_copy_span_grid_on_the_cpu_copies_every_repeat():
    src = torch.arange(200, dtype=torch.uint8)
    dst = torch.zeros(300, dtype=torch.uint8)
    a, b = src.data_ptr(), dst.data_ptr()
    calls = copy_span_grid([b + 1, b + 20], [a, a + 10], [4, 3], height=3, dst_pitch=100,
                           src_pitch=50, device=torch.device("cpu"))
    assert calls == 6
    expect = torch.zeros(300, dtype=torch.uint8)
    for k in range(3):
        expect[1 + 100 * k:5 + 100 * k] = src[50 * k:4 + 50 * k]
        expect[20 + 100 * k:23 + 100 * k] = src[10 + 50 * k:13 + 50 * k]
    assert torch.equal(dst, expect)
    with pytest.raises(ValueError, match="height"):
        copy_span_grid([b], [a], [1], height=0, dst_pitch=8, src_pitch=8,
                       device=torch.device("cpu"))
    with pytest.raises(ValueError, match="overlap"):
        copy_span_grid([b], [a], [10], height=2, dst_pitch=8, src_pitch=80,
                       device=torch.device("cpu"))
    assert torch.equal(dst, expect)  # refused before anything was copied


def test_copy_spans_on_the_cpu_moves_each_span():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    a, b = src.data_ptr(), dst.data_ptr()
    calls = copy_spans([b + 10, b + 40], [a, a + 20], [5, 3], device=torch.device("cpu"))
    assert calls == 2
    expect = torch.zeros(64, dtype=torch.uint8)
    expect[10:15] = src[0:5]
    expect[40:43] = src[20:23]
    assert torch.equal(dst, expect)
    assert copy_spans([], [], [], device=torch.device("cpu")) == 0
    with pytest.raises(ValueError, match="differ in length"):
        copy_spans([b], [a, a], [1], device=torch.device("cpu"))
    assert ctypes.c_uint8.from_address(b + 42).value == 22


def test_ring_is_reused_never_resized_in_place_and_sized_by_the_staging(monkeypatch):
    kv = build_cache([("kv", 2, 100, torch.uint8, 0, True)], 8)
    buf = kv.row_pool.buffers["kv"]
    monkeypatch.setenv(ENV_RING_BYTES, "2000")
    assert ring_capacity(buf) == 10 and ring_capacity(buf, staging_rows=4) == 4
    ring = ring_for(buf)
    assert ring.capacity == 10 and ring_for(buf) is ring
    monkeypatch.setenv(ENV_RING_BYTES, "4000")
    assert ring_for(buf) is ring, "a ring in use was resized behind its users"
    bigger = ring_for(buf, capacity=20)  # an explicit size: a new ring, the old one left intact
    assert bigger is not ring and bigger.capacity == 20 and ring.tensor.shape == (2, 10, 100)
    assert ring_for(buf) is bigger
    with pytest.raises(ValueError, match="capacity"):
        ring_for(buf, capacity=0)
    monkeypatch.setenv(ENV_RING_BYTES, "lots")
    with pytest.raises(ValueError, match=ENV_RING_BYTES):
        ring_capacity(buf)


def test_two_hop_is_a_backend_and_auto_stays_torch_on_the_cpu():
    assert resolve_backend("two_hop", torch.device("cpu")) == "two_hop"
    assert resolve_backend("auto", torch.device("cpu"), direction="gather", row_bytes=656) \
        == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("copy_engine", torch.device("cpu"))


def test_device_resident_rows_are_refused_before_anything_is_read():
    """The two-hop path works out its spans on the host; reading device rows there waits for
    the device (a host sync in the decode loop). Device-resident rows go
    to the direct kernel (:class:`PreparedCopy` routes them); given here they are refused
    before any value is read. Meta tensors stand for device memory: they hold no values, so
    reading one fails."""
    kv = kvmove.KVCache({"kv": torch.zeros(2, 16, 8, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4)
    src, dst = kv.row_pool.buffers["kv"], staging.row_pool.buffers["kv"]
    on_device = torch.arange(4, device="meta")
    for rows in ((on_device, torch.arange(4)), (torch.arange(4), on_device)):
        with pytest.raises(ValueError, match=r"reads (src|dst)_rows on the host"):
            copy_rows_two_hop(src, dst, [0, 1], *rows, None, direction="gather")
