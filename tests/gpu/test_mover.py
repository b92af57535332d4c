"""The mover inside an engine, on a GPU, with an in-memory store (no test here is skipped
for want of Mooncake): indices written on the engine's stream just before the call;
calls that never wait for the device, with device indices, host indices as vLLM passes
them (pageable) and pinned ones, on the direct and the two-hop path (a busy device tells:
no process-wide sync-debug mode racing with the mover's workers); ``wait_layer`` ordering
the engine after each layer; a prefetch run by its waiting caller; a prefetch larger than
the staging whose first piece misses runs nothing early; a mover built on a live cache
writes nothing; host indices the engine refills at once; device indices with a bad row; a
cache on a second GPU."""

from __future__ import annotations

import threading

import pytest
import torch

import kvmove
from kvmove.status import BAD_ROWS
from tests.gpu.common import (
    CUDA,
    BusyDevice,
    build,
    kv_bytes,
    random_pages,
    staging_bytes,
)

OK = kvmove.Status.OK
BUFFERS = [("kv", 4, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)]


def disjoint_pages(kv_slots, n, pt, seed=0):
    """Two ``[n, pt]`` page sets of distinct KV rows, none shared between them."""
    both = random_pages(kv_slots, 2 * n, pt, pad=False, seed=seed)
    return both[:n], both[n:]


def rows_of(kv, name, layer, pages):
    return kv.layer(name, layer)[pages.reshape(-1).to(kv.device)].cpu()


def place(pages: torch.Tensor, where: str) -> torch.Tensor:
    if where == "device":
        return pages.to(CUDA)
    if where == "pinned":
        return pages.pin_memory()
    return pages.clone()  # pageable host memory, as vLLM's connector passes them


def test_round_trip_with_indices_written_on_the_engine_stream(gpu_store, keyspace):
    pt, n, kv_slots = 16, 6, 2048
    engine = torch.cuda.Stream()
    engine.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(engine):
        kv = build(BUFFERS, kv_slots)
        expect = kv_bytes(kv)
        mover = kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=16)
        try:
            keys = keyspace(n)
            src, dst = disjoint_pages(kv_slots, n, pt)
            src, dst = src.to(CUDA), dst.to(CUDA)
            pages = torch.full_like(src, -1)
            BusyDevice(0.2)  # the indices land late, after a busy engine
            pages.copy_(src)  # written by a kernel on the engine stream just before the call
            t = mover.evict(keys, pages)
            engine.wait_event(t.gathered)
            for name in kv.buffer_names:  # the engine reuses the evicted rows at once
                for layer in range(kv.num_layers(name)):
                    kv.layer(name, layer)[src.reshape(-1)] = 0
            assert t.wait(60) == [OK] * n
            free = torch.full_like(dst, -1)
            BusyDevice(0.2)
            free.copy_(dst)
            p = mover.prefetch(keys, free)
            engine.wait_event(p.scattered)
            got = {name: [kv.layer(name, i)[dst.reshape(-1)].cpu()
                          for i in range(kv.num_layers(name))] for name in kv.buffer_names}
            assert p.wait(60) == [OK] * n
        finally:
            mover.close()
    rows = src.reshape(-1).cpu()
    for name in expect:
        for layer, layer_bytes in enumerate(expect[name]):
            assert torch.equal(got[name][layer], layer_bytes[rows]), f"{name} layer {layer}"


@pytest.mark.parametrize("indices", ["device", "pageable", "pinned"])
@pytest.mark.parametrize("backend", ["triton", "two_hop"])
def test_evict_and_layerwise_prefetch_never_wait_for_the_device(backend, indices, gpu_store,
                                                                  keyspace):
    """The engine's thread is back from ``evict`` and from every ``wait_layer`` while the
    device still runs the work queued before the call: nothing in them waits for the device
    (no host sync, no stream synchronize, no upload from pageable memory). On the two-hop
    path host indices take the copy engine, device indices the direct kernel."""
    pt, n, kv_slots = 16, 6, 2048
    kv = build(BUFFERS, kv_slots)
    expect = kv_bytes(kv)
    src, dst = disjoint_pages(kv_slots, n, pt, seed=2)
    with kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=8,
                        backend=backend) as mover:
        warm_src = disjoint_pages(kv_slots, n, pt, seed=9)[0]
        warm = keyspace(n, "warm")
        assert mover.evict(warm, place(warm_src, indices)).wait(60) == [OK] * n
        w = mover.prefetch(warm, place(warm_src, indices), layerwise=True)
        assert w.wait(60) == [OK] * n  # the same rows back: nothing changes
        torch.cuda.synchronize()
        keys = keyspace(n)
        # Placed before the busy spell: a test's own upload from pageable memory would wait.
        src_in, dst_in = place(src, indices), place(dst, indices)
        torch.cuda.synchronize()
        busy = BusyDevice()
        t = mover.evict(keys, src_in)
        assert busy.still_busy(), f"evict ({backend}, {indices} indices) waited for the device"
        assert t.wait(60) == [OK] * n
        busy = BusyDevice()
        p = mover.prefetch(keys, dst_in, layerwise=True)
        for layer in range(kv.max_layers):
            p.wait_layer(layer, timeout=60)
        assert busy.still_busy(), f"wait_layer ({backend}, {indices}) waited for the device"
        assert p.wait(60) == [OK] * n
        p.scattered.synchronize()
    for name in expect:
        for layer in range(kv.num_layers(name)):
            assert torch.equal(rows_of(kv, name, layer, dst),
                               expect[name][layer][src.reshape(-1)]), f"{name} layer {layer}"


def test_wait_layer_orders_the_engine_after_each_layer(gpu_store, keyspace):
    """After ``wait_layer(l)`` the engine's stream reads layer ``l`` of the prefetched rows
    and finds them, although the scatter had not run when ``wait_layer`` returned (it is
    queued after a busy device)."""
    pt, n, kv_slots = 16, 8, 4096
    kv = build([("kv", 8, 656, torch.uint8, 0), ("ix", 3, 132, torch.uint8, 0)], kv_slots)
    src, dst = disjoint_pages(kv_slots, n, pt, seed=4)
    expect = {name: [rows_of(kv, name, layer, src) for layer in range(kv.num_layers(name))]
              for name in kv.buffer_names}
    with kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=n) as mover:
        keys = keyspace(n)
        assert mover.evict(keys, src).wait(60) == [OK] * n
        torch.cuda.synchronize()
        rows, on_device = dst.reshape(-1).to(CUDA), dst.to(CUDA)  # uploaded before the spell
        read = {name: [] for name in kv.buffer_names}
        BusyDevice(1.0)
        p = mover.prefetch(keys, on_device, layerwise=True)
        for layer in range(kv.max_layers):
            p.wait_layer(layer, timeout=60)
            for name in kv.buffer_names:  # the engine's next kernel reads the layer
                if layer < kv.num_layers(name):
                    read[name].append(kv.layer(name, layer)[rows].clone())
        assert p.wait(60) == [OK] * n
        torch.cuda.synchronize()
    for name in kv.buffer_names:
        for layer, got in enumerate(read[name]):
            assert torch.equal(got.cpu(), expect[name][layer]), \
                f"the engine read {name} layer {layer} before its scatter"


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_prefetch_run_by_its_waiting_caller_keeps_the_engine_stream(layerwise, gpu_store,
                                                                      keyspace):
    """A ``wait()`` that finds the staged prefetch still queued (the only worker busy) runs
    it on the engine's thread: the scatter still waits for the indices written on the
    engine's stream just before the call, the rows are in place when ``wait()`` returns,
    and the engine's thread is left on its own stream (the job's stream is the mover's)."""
    pt, n, kv_slots = 16, 6, 2048
    kv = build(BUFFERS, kv_slots)
    expect = kv_bytes(kv)
    src, dst = disjoint_pages(kv_slots, n, pt, seed=6)
    engine = torch.cuda.Stream()
    engine.wait_stream(torch.cuda.current_stream())
    mover = kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=8, workers=1,
                           path="staged")
    gate = threading.Event()
    ran_on = []
    inner = mover._prefetch_path._get_job

    def recorded(*args):
        ran_on.append(threading.current_thread())
        return inner(*args)

    try:
        keys = keyspace(n)
        assert mover.evict(keys, src.to(CUDA)).wait(60) == [OK] * n
        mover._prefetch_path._get_job = recorded
        mover._life.executor.submit(gate.wait, 60)  # the only worker is busy
        dst_on_device = dst.to(CUDA)  # uploaded before the busy spell
        torch.cuda.synchronize()
        with torch.cuda.stream(engine):
            free = torch.full((n, pt), -1, dtype=torch.int64, device=CUDA)
            BusyDevice(0.2)  # the indices land late, after a busy engine
            free.copy_(dst_on_device)
            t = mover.prefetch(keys, free, layerwise=layerwise)
            assert t.wait() == [OK] * n
            assert torch.cuda.current_stream() == engine
            got = {name: [kv.layer(name, i)[dst.reshape(-1).to(CUDA)].cpu()
                          for i in range(kv.num_layers(name))] for name in kv.buffer_names}
    finally:
        gate.set()
        mover.close()
    assert ran_on == [threading.current_thread()]
    rows = src.reshape(-1)
    for name in expect:
        for layer, layer_bytes in enumerate(expect[name]):
            assert torch.equal(got[name][layer], layer_bytes[rows]), f"{name} layer {layer}"


@pytest.mark.parametrize("indices", ["device", "pageable"])
def test_a_prefetch_larger_than_the_staging_whose_first_piece_misses(indices, gpu_store,
                                                                     keyspace):
    """Six keys through two staging slots: three pieces, the first all misses (it scatters
    nothing). The destination indices are written on the engine's stream after a busy
    spell, just before the call: every later piece must wait for them (the first piece
    used to be the only one ordered after the caller), or it scatters to rows of the
    indices' old values."""
    pt, n, kv_slots = 16, 6, 2048
    kv = build(BUFFERS, kv_slots)
    src, dst = disjoint_pages(kv_slots, n, pt, seed=6)
    keys = keyspace(n)
    with kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=2) as mover:
        assert mover.evict(keys[2:], src[2:]).wait(60) == [OK] * 4
        torch.cuda.synchronize()
        before = kv_bytes(kv)
        pages = place(torch.full_like(dst, -1), "device" if indices == "device" else "pinned")
        on_device = dst.to(CUDA)  # uploaded before the spell (an upload would wait for it)
        BusyDevice(1.0)
        if indices == "device":
            pages.copy_(on_device)  # written on the engine's stream, after the spell
        else:
            pages.copy_(dst)  # host indices: written now (the mover snapshots them)
        p = mover.prefetch(keys, pages)
        assert p.wait(60) == [kvmove.Status.MISS] * 2 + [OK] * 4
        p.scattered.synchronize()
        torch.cuda.synchronize()
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            assert torch.equal(rows_of(kv, name, layer, dst[2:]),
                               before[name][layer][src[2:].reshape(-1)]), f"{name} {layer}"
            assert torch.equal(rows_of(kv, name, layer, dst[:2]),
                               before[name][layer][dst[:2].reshape(-1)])  # missed: untouched


@pytest.mark.parametrize("backend", ["triton", "two_hop"])
def test_a_mover_built_on_a_live_cache_writes_nothing(backend, gpu_store, monkeypatch):
    """The warm-up's skip indices are made on the evict stream that reads them. Made on the
    caller's stream, behind the engine's queued work, the warm-up launches read them before
    they are written: here the caching allocator hands them a block that held row 3, so
    such launches would copy KV row 3 into staging and back. The engine's work is queued
    right before the warm-up (the mover's construction uploads its address tables, which
    waits for the caller's stream, before it)."""
    kv = build(BUFFERS, 1024)
    expect = kv_bytes(kv)
    held = [torch.full((1,), 3, dtype=torch.int64, device=CUDA) for _ in range(64)]
    torch.cuda.synchronize()
    del held  # free blocks that hold a valid row number, on the caller's stream
    warm_up = kvmove.KVMover._warm_up

    def behind_a_busy_engine(mover):
        BusyDevice(1.0)  # the engine's queued work on the caller's stream
        warm_up(mover)

    monkeypatch.setattr(kvmove.KVMover, "_warm_up", behind_a_busy_engine)
    mover = kvmove.KVMover(kv, gpu_store, page_tokens=16, staging_slots=4, backend=backend)
    torch.cuda.synchronize()
    try:
        for name, data in staging_bytes(mover.staging).items():
            assert not data.any(), f"the warm-up wrote staging {name}"
        after = kv_bytes(kv)
        for name in expect:
            for layer in range(len(expect[name])):
                assert torch.equal(after[name][layer], expect[name][layer])
    finally:
        mover.close()


@pytest.mark.parametrize("memory", ["pageable", "pinned"])
@pytest.mark.parametrize("backend", ["triton", "two_hop"])
def test_host_indices_the_engine_refills_at_once(backend, memory):
    """``gather``/``scatter`` with host indices return without waiting for the device, and
    move the rows the indices named at the call: the engine refills its (pinned) index
    buffer at once, while the upload is still queued behind its work."""
    pt, n, kv_slots = 16, 5, 1024
    kv = build(BUFFERS, kv_slots)
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=pt)
    pages, later = disjoint_pages(kv_slots, n, pt, seed=8)
    slots = torch.tensor([6, 1, 3, 0, 4])
    buffer = pages.pin_memory() if memory == "pinned" else pages.clone()
    reference = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=pt)
    kvmove.gather(kv, reference, pages, slots, backend="torch")
    kvmove.gather(kv, staging, buffer, slots, backend=backend)  # warm
    torch.cuda.synchronize()
    for name in staging.buffer_names:
        staging.tensor(name).zero_()
    busy = BusyDevice()
    kvmove.gather(kv, staging, buffer, slots, backend=backend)
    assert busy.still_busy(), f"gather ({backend}, {memory} indices) waited for the device"
    buffer.copy_(later)  # the engine's next step
    torch.cuda.synchronize()
    for name in staging.buffer_names:
        assert torch.equal(staging.tensor(name)[:, slots], reference.tensor(name)[:, slots])
    other = build(BUFFERS, kv_slots, seed=12)
    kvmove.scatter(staging, slots, other, later.clone(), backend=backend)  # warm (other rows)
    torch.cuda.synchronize()
    buffer.copy_(pages)
    busy = BusyDevice()
    kvmove.scatter(staging, slots, other, buffer, backend=backend)
    assert busy.still_busy(), f"scatter ({backend}, {memory} indices) waited for the device"
    buffer.copy_(later)
    torch.cuda.synchronize()
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            assert torch.equal(rows_of(other, name, layer, pages), rows_of(kv, name, layer, pages))


def test_device_indices_with_a_bad_row_fail_that_key_only(gpu_store, keyspace):
    """Device-resident indices are checked on the device: the key whose page names a row
    past the cache ends FAILED (BAD_ROWS) without the call waiting for the device, is never
    stored and never scattered; the others move; a prefetch whose keys all miss ends
    cleanly."""
    pt, kv_slots = 16, 1024
    kv = build([("kv", 3, 656, torch.uint8, 0)], kv_slots)
    expect = kv_bytes(kv)
    mover = kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=8)
    try:
        keys = keyspace(3)
        pages, dst = disjoint_pages(kv_slots, 3, pt, seed=5)
        pages, dst = pages.to(CUDA), dst.to(CUDA)
        pages[1, 5] = kv_slots + 7  # past the cache
        busy = BusyDevice()
        t = mover.evict(keys, pages)
        assert busy.still_busy(), "evict with device indices waited for the device"
        result = t.result(60)
        assert result.statuses[0] is OK and result.statuses[2] is OK
        assert result.statuses[1] is kvmove.Status.FAILED and result.codes[1] == BAD_ROWS
        assert gpu_store.exists(mover.keyspace.store_keys(keys)) == [True, False, True]
        dst[1, 0] = -5  # a found key with a bad destination row
        before = kv_bytes(kv)
        p = mover.prefetch([keys[0], keys[2], keys[2] + "-x"], dst)
        got = p.result(60)
        p.scattered.synchronize()
        assert got.statuses[0] is OK
        assert got.statuses[1] is kvmove.Status.FAILED and got.codes[1] == BAD_ROWS
        assert got.statuses[2] is kvmove.Status.MISS
        after = kv_bytes(kv)
        src0 = pages[0].cpu()
        for name in expect:
            for layer in range(len(expect[name])):
                assert torch.equal(after[name][layer][dst[0].cpu()], expect[name][layer][src0])
                for i in (1, 2):  # untouched
                    rows = dst[i].cpu()
                    rows = rows[(rows >= 0) & (rows < kv_slots)]
                    assert torch.equal(after[name][layer][rows], before[name][layer][rows])
        missing = mover.prefetch(keyspace(2, "none"), dst[:2])
        assert missing.wait(60) == [kvmove.Status.MISS] * 2
        missing.scattered.synchronize()
    finally:
        mover.close()


@pytest.mark.multi_gpu
def test_kv_on_a_second_gpu_with_the_first_current():
    dev1 = torch.device("cuda", 1)
    with torch.cuda.device(dev1):
        kv = build(BUFFERS, 512)
    assert kv.device == dev1 and torch.cuda.current_device() == 0
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=16)
    pages, slots = random_pages(512, 4, 16), torch.tensor([5, 0, 2, 3])
    reference = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=16)
    kvmove.gather(kv, reference, pages, slots, backend="torch")
    for backend in ("triton", "two_hop"):
        kvmove.gather(kv, staging, pages, slots, backend=backend)
        torch.cuda.synchronize(dev1)
        for name in kv.buffer_names:
            assert torch.equal(staging.tensor(name), reference.tensor(name))
        with torch.cuda.device(dev1):
            other = build(BUFFERS, 512, seed=3)
        kvmove.scatter(staging, slots, other, pages, backend=backend)
        torch.cuda.synchronize(dev1)
        rows = pages.reshape(-1)
        rows = rows[rows >= 0].to(dev1)
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                assert torch.equal(other.layer(name, layer)[rows], kv.layer(name, layer)[rows])
        assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("backend", ["triton", "two_hop"])
def test_the_first_copy_of_a_new_cache_never_waits_for_the_device(backend):
    """The first gather and scatter of a cache the process has not copied before (its
    address tables and rows are made then) return while the device still runs the work
    queued before them, and move the right rows. Device indices, uploaded before the
    spell; the kernel compiled by a copy of another cache first."""
    pt, n, kv_slots = 16, 5, 1024
    warm = build(BUFFERS, kv_slots, seed=20)
    warm_staging = kvmove.StagingBuffer(warm, num_slots=8, page_tokens=pt)
    pages, later = disjoint_pages(kv_slots, n, pt, seed=21)
    slots = torch.tensor([6, 1, 3, 0, 4])
    kvmove.gather(warm, warm_staging, pages.to(CUDA), slots, backend=backend)
    kvmove.scatter(warm_staging, slots, warm, later.to(CUDA), backend=backend)
    kv, other = build(BUFFERS, kv_slots, seed=22), build(BUFFERS, kv_slots, seed=23)
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=pt)
    on_device, on_device_later = pages.to(CUDA), later.to(CUDA)
    torch.cuda.synchronize()
    busy = BusyDevice()
    kvmove.gather(kv, staging, on_device, slots, backend=backend)
    assert busy.still_busy(), f"the first gather ({backend}) waited for the device"
    busy = BusyDevice()
    kvmove.scatter(staging, slots, other, on_device_later, backend=backend)
    assert busy.still_busy(), f"the first scatter ({backend}) waited for the device"
    torch.cuda.synchronize()
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            assert torch.equal(rows_of(other, name, layer, later),
                               rows_of(kv, name, layer, pages)), f"{name} layer {layer}"


@pytest.mark.parametrize("backend", ["triton", "two_hop"])
def test_the_mover_compiles_nothing_while_serving(backend, gpu_store, keyspace):
    """Every kernel an evict or a prefetch (whole or layer-wise, host or device indices)
    launches was compiled by the mover's warm-up: none is compiled in the decode loop."""
    from tests.gpu.common import compiled_kernels

    pt, n, kv_slots = 16, 4, 1024
    kv = build(BUFFERS, kv_slots, seed=30)
    src, dst = disjoint_pages(kv_slots, n, pt, seed=31)
    with kvmove.KVMover(kv, gpu_store, page_tokens=pt, staging_slots=8,
                        backend=backend) as mover:
        torch.cuda.synchronize()
        before = compiled_kernels()
        for where in ("pageable", "device"):
            keys = keyspace(n, where)
            assert mover.evict(keys, place(src, where)).wait(60) == [OK] * n
            assert mover.prefetch(keys, place(dst, where)).wait(60) == [OK] * n
            assert mover.prefetch(keys, place(dst, where), layerwise=True).wait(60) == [OK] * n
        torch.cuda.synchronize()
        assert compiled_kernels() == before, "a call compiled a kernel the warm-up did not"
