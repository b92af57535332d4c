"""The per-call host work of a GPU copy, on a GPU: after a launch of each specialisation,
launches go straight to the compiled kernel (Triton's binding is not run), hand its
launcher what Triton's own run hands it, and move the same bytes as the torch backend,
whatever the index dtypes, page slots or error counting; a launch hook (a profiler) still
sees every launch; every call that returns an error counter gets a fresh zeroed one, on
any stream, and a captured call's counter counts each replay afresh."""

from __future__ import annotations

import pytest
import torch

import kvmove
from kvmove.kernels import row_copy
from tests.gpu.common import CUDA, assert_equal, build, random_pages, staging_bytes


def _moves(kv, staging, ref, seed, dtype, errors):
    """One gather and one scatter through the triton backend, the same through torch into
    ``ref``; returns the error counters of the triton calls."""
    pages = random_pages(kv.num_slots, 6, staging.page_tokens, seed=seed, dtype=dtype)
    slots = torch.randperm(staging.num_slots, generator=torch.Generator().manual_seed(seed))
    slots = slots[:6].to(dtype)
    got = [kvmove.gather(kv, staging, pages.to(CUDA), slots.to(CUDA), backend="triton",
                         check=False, errors=errors)]
    kvmove.gather(kv, ref, pages, slots, backend="torch")
    back = random_pages(kv.num_slots, 6, staging.page_tokens, seed=seed + 50, dtype=dtype)
    got.append(kvmove.scatter(staging, slots, kv, back, backend="triton", check=False))
    return got, (slots, back)


@pytest.mark.parametrize("page_tokens", [1, 16])
def test_launches_after_the_first_skip_tritons_binding_and_move_the_same_bytes(
        monkeypatch, page_tokens):
    kv = build([("kv", 4, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)], 2048)
    staging = kvmove.StagingBuffer(kv, num_slots=16, page_tokens=page_tokens)
    ref = kvmove.StagingBuffer(kv, num_slots=16, page_tokens=page_tokens)
    counter = torch.zeros(1, dtype=torch.int32, device=CUDA)
    through_triton = []
    real_run = row_copy._copy_rows_kernel.run

    def counted_run(*args, **kwargs):
        through_triton.append(1)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(row_copy._copy_rows_kernel, "run", counted_run)
    for round_ in range(2):
        through_triton.clear()
        for i, (dtype, errors) in enumerate([(torch.int64, None), (torch.int32, None),
                                             (torch.int64, counter)]):
            seed = 10 * round_ + i
            expect_kv = build([("kv", 4, 656, torch.uint8, 0), ("ix", 2, 132, torch.uint8, 0)],
                              2048)
            for name in kv.buffer_names:  # the cache, as the scatter will leave it
                for layer in range(kv.num_layers(name)):
                    expect_kv.layer(name, layer).copy_(kv.layer(name, layer))
            _, (slots, back) = _moves(kv, staging, ref, seed, dtype, errors)
            kvmove.scatter(ref, slots, expect_kv, back, backend="torch")
            torch.cuda.synchronize()
            assert_equal(staging_bytes(staging), staging_bytes(ref))
            for name in kv.buffer_names:
                for layer in range(kv.num_layers(name)):
                    assert torch.equal(kv.layer(name, layer), expect_kv.layer(name, layer)), \
                        f"round {round_}, {dtype}: scatter of {name} layer {layer} differs"
        if round_ == 1 and row_copy._launches.enabled:  # not under the kill switch
            assert not through_triton, "a launch of a seen specialisation went through Triton"
    assert int(counter) == 0


def test_a_launch_hook_sees_every_launch():
    from triton import knobs

    kv = build([("kv", 2, 656, torch.uint8, 0)], 512)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    pages, slots = torch.arange(4, device=CUDA).reshape(4, 1), torch.arange(4, device=CUDA)
    kvmove.gather(kv, staging, pages, slots, backend="triton", check=False)  # compiled
    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            kvmove.gather(kv, staging, pages, slots, backend="triton", check=False)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 3


def test_every_call_gets_a_fresh_zeroed_error_counter_on_any_stream():
    kv = build([("kv", 2, 656, torch.uint8, 0)], 64)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    bad = torch.tensor([[70], [1], [99], [2]], device=CUDA)  # two rows out of range
    slots = torch.arange(4, device=CUDA)
    counters = []
    side = torch.cuda.Stream()
    for i in range(2500):  # more than one block of counters on each of two streams
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            counters.append(kvmove.gather(kv, staging, bad, slots, backend="triton",
                                          check=False))
    torch.cuda.synchronize()
    assert len({c.data_ptr() for c in counters}) == len(counters)
    assert all(c.dtype == torch.int32 and c.numel() == 1 for c in counters)
    assert torch.cat(counters).tolist() == [2] * len(counters)


def test_a_captured_call_counts_each_replay_afresh():
    """Under capture the counter is zeroed by the graph itself: each replay counts its own
    bad rows (a counter handed out before the capture would add them up)."""
    kv = build([("kv", 2, 656, torch.uint8, 0)], 64)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    bad = torch.tensor([[70], [1], [99], [2]], device=CUDA)  # two rows out of range
    slots = torch.arange(4, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kvmove.gather(kv, staging, bad, slots, backend="triton", check=False)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counter = kvmove.gather(kv, staging, bad, slots, backend="triton", check=False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert int(counter) == 2


def test_the_direct_launch_passes_the_launcher_what_tritons_run_passes():
    """The compiled kernel's launcher gets the same arguments from the direct launch as from
    Triton's own ``kernel[grid](...)`` (but the launch metadata and the hooks, unused when
    no hook is set)."""
    from kvmove.kernels.compiled_launch import _options

    if not row_copy._launches.enabled:
        pytest.skip("the direct launch is off (KVMOVE_TRITON_FAST_LAUNCH=0 or Triton version)")
    kv = build([("kv", 2, 656, torch.uint8, 0)], 64)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    pages, slots = torch.arange(4, device=CUDA).reshape(4, 1), torch.arange(4, device=CUDA)
    kvmove.gather(kv, staging, pages, slots, backend="triton", check=False)  # compiled
    seen = []
    real = row_copy._launches.launch

    def spy(key, grid, args, device_index, num_warps):
        seen.append((key, grid, args, device_index, num_warps))
        return real(key, grid, args, device_index, num_warps)

    row_copy._launches.launch = spy
    try:
        kvmove.gather(kv, staging, pages, slots, backend="triton", check=False)
    finally:
        del row_copy._launches.launch
    (key, grid, args, device_index, num_warps), = seen
    kernel = row_copy._launches._kernels[(key, *_options())]
    runs = []
    launcher = kernel.run

    def recording(*a):
        runs.append(a)
        return launcher(*a)

    kernel._run = recording
    try:
        row_copy._launches.launch(key, grid, args, device_index, num_warps)  # direct
        row_copy._launches.through_triton(row_copy._copy_rows_kernel, grid, args,
                                          num_warps)  # Triton's run, same compiled kernel
    finally:
        kernel._run = launcher
    torch.cuda.synchronize()
    assert len(runs) == 2, "Triton's run did not launch the kept compiled kernel"
    direct, triton_run = runs

    def same(a, b):
        return a is b or (not isinstance(a, torch.Tensor) and a == b)

    keep = [i for i in range(len(direct)) if i not in (6, 7, 8)]  # metadata, two hooks
    assert len(direct) == len(triton_run)
    assert all(same(direct[i], triton_run[i]) for i in keep), \
        [(i, direct[i], triton_run[i]) for i in keep if not same(direct[i], triton_run[i])]
