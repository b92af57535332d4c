"""The compiled Triton kernel on a GPU: against the torch backend with the KV on the GPU
and pinned, device-accessible staging; one layer of a layer-wise scatter; bad rows counted
and never written with ``check=False``; no new compile for a new batch size or for index
slices at odd offsets; graph capture with fixed index buffers."""

from __future__ import annotations

import pytest
import torch

import kvmove
from tests.gpu.common import (
    CUDA,
    assert_equal,
    build,
    compiled_kernels,
    cuda_layers,
    kv_bytes,
    random_pages,
    staging_bytes,
)


def test_the_kernel_is_compiled_not_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    from kvmove.kernels import row_copy

    assert not isinstance(row_copy._copy_rows_kernel, InterpretedFunction), (
        "TRITON_INTERPRET was set when kvmove.kernels.row_copy was imported")


def test_staging_is_pinned_and_device_accessible():
    kv = kvmove.KVCache({"kv": cuda_layers(2, 64, 656, torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    assert staging.pinned
    t = staging.tensor("kv")
    assert t.device.type == "cpu" and t.is_pinned()
    # A device-side copy through the registered address lands in the host memory.
    errors = kvmove.gather(kv, staging, torch.arange(16)[None, :], torch.tensor([2]),
                           backend="triton")
    torch.cuda.synchronize()
    assert int(errors) == 0
    assert torch.equal(t[1, 2].view(16, 656), kv.layer("kv", 1)[:16].cpu())


CASES = [  # (buffers: [(name, layers, row bytes, dtype, pad)], page_tokens)
    ([("kv", 4, 656, torch.uint8, 0)], 64),
    ([("kv", 3, 1152, torch.bfloat16, 0), ("ix", 2, 132, torch.uint8, 0)], 16),
    ([("k", 2, 4096, torch.float16, 4), ("v", 2, 4096, torch.float16, 0)], 1),
    ([("kv", 2, 657, torch.uint8, 3)], 5),  # odd rows and pitch: narrow accesses
    ([("kv", 61, 656, torch.uint8, 0)], 64),
]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("buffers", "page_tokens"), CASES)
def test_triton_gather_and_scatter_match_torch(buffers, page_tokens, index_dtype):
    kv_slots, n = 512, 7
    token_pages = random_pages(kv_slots, n, page_tokens, dtype=index_dtype)
    slots = torch.tensor([9, 3, 4, 5, 0, 11, 7], dtype=index_dtype)
    gathered = []
    for backend in ("torch", "triton"):
        kv = build(buffers, kv_slots)
        staging = kvmove.StagingBuffer(kv, num_slots=12, page_tokens=page_tokens)
        for name in staging.buffer_names:
            staging.tensor(name).fill_(0x5A)
        errors = kvmove.gather(kv, staging, token_pages, slots, backend=backend)
        torch.cuda.synchronize()
        assert int(errors) == 0
        gathered.append(staging_bytes(staging))
        other = build(buffers, kv_slots, seed=50)
        dst = random_pages(kv_slots, n, page_tokens, dtype=index_dtype, seed=1)
        dst[token_pages < 0] = -1
        kvmove.scatter(staging, slots, other, dst, backend=backend)
        torch.cuda.synchronize()
        gathered.append(kv_bytes(other))
    assert_equal(gathered[0], gathered[2])
    assert_equal(gathered[1], gathered[3])


def test_layerwise_scatter_writes_one_layer():
    buffers = [("kv", 4, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)]
    kv = build(buffers, 256)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    slots = torch.tensor([0, 1])
    kvmove.gather(kv, staging, random_pages(256, 2, 16, pad=False), slots)
    other = build(buffers, 256, seed=9)
    before = kv_bytes(other)
    dst = random_pages(256, 2, 16, pad=False, seed=3)
    kvmove.scatter(staging, slots, other, dst, layers=3, backend="triton")
    torch.cuda.synchronize()
    after = kv_bytes(other)
    for name in before:
        for layer, (x, y) in enumerate(zip(before[name], after[name], strict=True)):
            assert torch.equal(x, y) == (name != "kv" or layer != 3)


def test_unchecked_bad_rows_are_counted_and_never_written():
    guard = torch.randint(0, 256, (3, 40, 656), dtype=torch.uint8, device=CUDA)
    kv = kvmove.KVCache({"kv": [guard[i, 4:36] for i in range(3)]})  # rows 0..31 of 40
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    staging.tensor("kv").fill_(7)
    errors = kvmove.gather(kv, staging, torch.tensor([[0, 32, 1000, 2], [3, -7, -1, 4]]),
                           torch.tensor([0, 9]), backend="triton", check=False)
    torch.cuda.synchronize()
    assert int(errors) == 2 + 4  # rows 32 and 1000; the four rows of slot 9 (-7 among them)
    before = guard.clone()
    errors = kvmove.scatter(staging, torch.tensor([0, 1]), kv,
                            torch.tensor([[32, 33, -3, 10**9], [-1, -1, -1, 40]]),
                            backend="triton", check=False)
    torch.cuda.synchronize()
    assert int(errors) == 5
    assert torch.equal(before, guard)  # guard rows and the cache itself untouched


def test_batch_sizes_and_odd_index_slices_compile_nothing_new():
    """A new batch size, and a piece of a larger call whose device indices start at an odd
    element (a pointer 8- or 4-byte aligned, not 16), run the kernels compiled first."""
    kv = build([("kv", 3, 656, torch.uint8, 0)], 4096)
    staging = kvmove.StagingBuffer(kv, num_slots=64, page_tokens=1)
    g = torch.Generator().manual_seed(4)

    def once(n, dtype=torch.int64, offset=0):
        pages = random_pages(4096, n + offset, 1, seed=n, pad=False, dtype=dtype).to(CUDA)
        slots = torch.randperm(64, generator=g)[: n + offset].to(CUDA, dtype)
        kvmove.gather(kv, staging, pages[offset:], slots[offset:], backend="triton",
                      check=False)
        kvmove.scatter(staging, slots[offset:], kv, pages[offset:], backend="triton",
                       check=False)

    for dtype in (torch.int64, torch.int32):
        once(3, dtype)
    torch.cuda.synchronize()
    before = compiled_kernels()
    assert before > 0
    for dtype in (torch.int64, torch.int32):
        for n in (1, 2, 5, 16, 17, 33, 7):
            for offset in (0, 1, 3):
                once(n, dtype, offset)
    torch.cuda.synchronize()
    assert compiled_kernels() == before, "a batch size or an index slice compiled a kernel"


def test_graph_captured_gather_and_scatter_replay_with_new_indices():
    """A user's capture: fixed-capacity device index buffers, a warm-up outside the graph,
    then replays after writing new indices into the same buffers. Relies on gather/scatter
    with device tensors and ``check=False`` neither allocating pageable host memory nor
    syncing the host (the pointer tables are built once, before the capture)."""
    pt, cap, kv_slots = 16, 8, 2048
    kv = build([("kv", 3, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)], kv_slots)
    staging = kvmove.StagingBuffer(kv, num_slots=cap, page_tokens=pt)
    other = build([("kv", 3, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)], kv_slots,
                  seed=11)
    pages = torch.full((cap, pt), -1, dtype=torch.int64, device=CUDA)
    slots = torch.arange(cap, device=CUDA)
    dst = torch.full((cap, pt), -1, dtype=torch.int64, device=CUDA)

    def step():
        kvmove.gather(kv, staging, pages, slots, backend="triton", check=False)
        kvmove.scatter(staging, slots, other, dst, backend="triton", check=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles, builds the tables
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        a = random_pages(kv_slots, cap, pt, seed=seed)
        b = random_pages(kv_slots, cap, pt, seed=seed + 100)
        b[a < 0] = -1
        pages.copy_(a)
        dst.copy_(b)
        # What the scatter must leave: every row as it was, but those b names (where a
        # names a row too: b is -1 wherever a is) hold a's rows of the cache.
        moved = ((a >= 0) & (b >= 0)).reshape(-1)
        rows_src, rows_dst = a.reshape(-1)[moved].to(CUDA), b.reshape(-1)[moved].to(CUDA)
        expect = {name: [] for name in kv.buffer_names}
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                want = other.layer(name, layer).clone()
                want[rows_dst] = kv.layer(name, layer)[rows_src]
                expect[name].append(want)
        graph.replay()
        torch.cuda.synchronize()
        ref = kvmove.StagingBuffer(kv, num_slots=cap, page_tokens=pt)
        kvmove.gather(kv, ref, a, torch.arange(cap), backend="torch")
        for name in kv.buffer_names:
            keep = (a >= 0).reshape(-1)
            got = staging.tensor(name).view(kv.num_layers(name), cap * pt, -1)[:, keep]
            want = ref.tensor(name).view(kv.num_layers(name), cap * pt, -1)[:, keep]
            assert torch.equal(got, want), f"replay {seed}: gather of {name} differs"
            for layer in range(kv.num_layers(name)):
                assert torch.equal(other.layer(name, layer), expect[name][layer]), \
                    f"replay {seed}: scatter of {name} layer {layer} differs"
