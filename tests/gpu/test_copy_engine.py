"""The copy engine and the two-hop path on a GPU: the two-hop path against the direct
kernel (batched and per-span copies, default and side streams, a ring small enough to
chunk); span copies on a side stream and 2-D grids, each in one batched call where the
driver has ``cuMemcpyBatchAsync`` (and no batch refused: the autouse fixture fails any
test whose batch the driver refused); registered host memory reached by the device at
its UVA address, which is what ``cudaHostGetDevicePointer`` answers."""

from __future__ import annotations

import pytest
import torch

import kvmove
from tests.gpu.common import CUDA, assert_equal, build, kv_bytes, random_pages, staging_bytes


def test_the_copy_engine_binding_is_here_and_batches_where_the_driver_can():
    from kvmove.memory import cuda_api

    assert cuda_api.copy_engine_problem() is None
    _, driver = cuda_api._bindings()
    err, version = driver.cuDriverGetVersion()
    assert int(err) == 0
    assert cuda_api.has_memcpy_batch() == (version >= cuda_api.BATCH_MIN_DRIVER)
    print(f"driver API {version}; cuMemcpyBatchAsync: {cuda_api.has_memcpy_batch()}")


@pytest.mark.parametrize("batch", ["1", "0"])
@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("ring", ["", "300000"])
def test_two_hop_matches_direct(batch, side_stream, ring, monkeypatch):
    monkeypatch.setenv("KVMOVE_COPY_BATCH", batch)
    monkeypatch.setenv("KVMOVE_RING_BYTES", ring)
    buffers = [("kv", 5, 656, torch.uint8, 0), ("ix", 3, 132, torch.uint8, 0)]
    kv_slots, n, pt = 2048, 24, 16
    token_pages = random_pages(kv_slots, n, pt)
    slots = torch.randperm(32)[:n]  # fragmented: many spans
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    out = []
    for backend in ("triton", "two_hop"):
        kv = build(buffers, kv_slots)
        staging = kvmove.StagingBuffer(kv, num_slots=32, page_tokens=pt)
        other = build(buffers, kv_slots, seed=7)
        dst = random_pages(kv_slots, n, pt, seed=2)
        dst[token_pages < 0] = -1
        stream.wait_stream(torch.cuda.current_stream())  # the caches were built on it
        with torch.cuda.stream(stream):
            kvmove.gather(kv, staging, token_pages, slots, backend=backend)
            kvmove.scatter(staging, slots, other, dst, backend=backend)
        torch.cuda.synchronize()
        out += [staging_bytes(staging), kv_bytes(other)]
    assert_equal(out[0], out[2])
    assert_equal(out[1], out[3])


def test_two_hop_with_device_rows_takes_the_direct_kernel():
    """Device-resident rows never reach the host: a two-hop copy given them runs the direct
    kernel (same bytes), the ring untouched."""
    from kvmove.rows.copy_engine.device_ring import ring_for

    buffers = [("kv", 3, 656, torch.uint8, 0)]
    kv = build(buffers, 1024)
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=16)
    reference = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=16)
    pages, slots = random_pages(1024, 5, 16), torch.tensor([7, 0, 3, 2, 5])
    ring = ring_for(kv.row_pool.buffers["kv"])
    last = ring._last_use
    kvmove.gather(kv, staging, pages.to(CUDA), slots.to(CUDA), backend="two_hop", check=False)
    kvmove.gather(kv, reference, pages, slots, backend="torch")
    torch.cuda.synchronize()
    assert ring._last_use is last  # the ring was not used
    assert_equal(staging_bytes(staging), staging_bytes(reference))


def test_copy_engine_spans_on_a_side_stream_in_one_call():
    from kvmove.rows.copy_engine.span_copies import copy_spans, cuda_copier

    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=CUDA)
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    starts = list(range(0, 1 << 20, 1 << 16))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # src was written on the default stream
    with torch.cuda.stream(stream):
        calls = copy_spans([host.data_ptr() + s for s in starts],
                           [src.data_ptr() + s for s in starts], [1 << 15] * len(starts),
                           device=CUDA, src_on_device=True, batch=True)
    stream.synchronize()
    has_batch = cuda_copier().has_batch
    print(f"cuMemcpyBatchAsync available: {has_batch}; {calls} call(s) for {len(starts)} spans")
    assert calls == (1 if has_batch else len(starts))
    expect = torch.zeros_like(host)
    cpu = src.cpu()
    for s in starts:
        expect[s:s + (1 << 15)] = cpu[s:s + (1 << 15)]
    assert torch.equal(host, expect)


@pytest.mark.parametrize("batch", [True, False])
def test_copy_engine_grid_covers_every_layer(batch):
    from kvmove.rows.copy_engine.span_copies import copy_span_grid, cuda_copier

    layers, pitch = 5, 1 << 16
    src = torch.randint(0, 256, (layers * pitch,), dtype=torch.uint8, device=CUDA)
    host = torch.zeros(layers * 2 * pitch, dtype=torch.uint8, pin_memory=True)
    starts, widths = [0, 4096, 40000], [1000, 8192, 656]
    calls = copy_span_grid([host.data_ptr() + s for s in starts],
                           [src.data_ptr() + s for s in starts], widths, height=layers,
                           dst_pitch=2 * pitch, src_pitch=pitch, device=CUDA,
                           src_on_device=True, batch=batch)
    torch.cuda.synchronize()
    print(f"grid copy, batch={batch}: {calls} call(s) for {len(starts) * layers} spans")
    expect = torch.zeros_like(host)
    cpu = src.cpu()
    for k in range(layers):
        for s, w in zip(starts, widths, strict=True):
            expect[2 * pitch * k + s:2 * pitch * k + s + w] = cpu[pitch * k + s:pitch * k + s + w]
    assert torch.equal(host, expect)
    if batch and cuda_copier().has_batch:
        assert calls == 1  # every span of every layer in one batched call
    else:
        assert calls == len(starts)  # one 2-D copy per span, covering every layer


def test_registered_memory_is_reached_at_its_uva_address():
    from kvmove.memory import cuda_api
    from kvmove.memory.host_memory import HostMemory

    memory = HostMemory(3 << 20, pin=True)
    assert memory.pinned and memory.registrations == [(memory.address, 3 << 20)]
    runtime, _ = cuda_api._bindings()
    err, pointer = runtime.cudaHostGetDevicePointer(memory.address, 0)
    assert int(err) == 0
    # What kvmove uses without any binding (UVA) is what the runtime answers here.
    assert memory.device_address == int(pointer) == memory.address
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=CUDA)
    stream = torch.cuda.current_stream().cuda_stream
    cuda_api.memcpy_async(memory.device_address + 12345, src.data_ptr(), 1 << 20, stream)
    back = torch.empty_like(src)
    cuda_api.memcpy_async(back.data_ptr(), memory.device_address + 12345, 1 << 20, stream)
    torch.cuda.synchronize()
    assert torch.equal(memory.tensor[12345:12345 + (1 << 20)], src.cpu())
    assert torch.equal(back, src)
    memory.close()
    assert not memory.pinned


def test_pinning_without_any_binding_copies_right(monkeypatch):
    """An engine's environment without cuda-bindings (nor cupy): staging is pinned through
    torch's runtime and the direct kernel writes it at the host address."""
    import sys

    from kvmove.memory import cuda_api

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    cuda_api._bindings.cache_clear()
    try:
        kv = build([("kv", 2, 656, torch.uint8, 0)], 256)
        staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
        assert staging.pinned
        pages = random_pages(256, 3, 16, pad=False)
        kvmove.gather(kv, staging, pages, torch.tensor([3, 0, 1]), backend="triton")
        torch.cuda.synchronize()
        for i, slot in enumerate((3, 0, 1)):
            got = staging.tensor("kv")[1, slot].view(16, 656)
            assert torch.equal(got, kv.layer("kv", 1)[pages[i].to(CUDA)].cpu())
        staging.close()
    finally:
        cuda_api._bindings.cache_clear()
