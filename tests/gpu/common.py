"""Helpers of the GPU tests: caches of random bytes on the GPU, random pages, byte
snapshots, and a busy device to tell a call that waits for the device from one that
does not (without torch's process-wide sync-debug mode, which the mover's worker threads,
which wait on purpose, would trip)."""

from __future__ import annotations

import torch

import kvmove

CUDA = torch.device("cuda")


def cuda_layers(layers, slots, row_bytes, dtype, *, pad=0, seed=0):
    """Per-layer CUDA tensors ``[slots, 1, row_bytes / itemsize]`` of random bytes; with
    ``pad`` > 0 the row pitch exceeds the row by ``pad`` elements."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    elems = row_bytes // itemsize
    g = torch.Generator(device=CUDA).manual_seed(seed)
    out = []
    for _ in range(layers):
        raw = torch.randint(0, 256, (slots * (elems + pad) * itemsize,), dtype=torch.uint8,
                            device=CUDA, generator=g)
        out.append(raw.view(dtype).view(slots, 1, elems + pad)[:, :, :elems])
    return out


def build(buffers, slots, seed=0) -> kvmove.KVCache:
    """A cache of ``buffers`` ``[(name, layers, row bytes, dtype, pad)]`` on the GPU."""
    return kvmove.KVCache({name: cuda_layers(layers, slots, rb, dt, pad=pad, seed=seed + i)
                           for i, (name, layers, rb, dt, pad) in enumerate(buffers)})


def random_pages(kv_slots, n, page_tokens, *, dtype=torch.int64, pad=True, seed=0):
    """``[n, page_tokens]`` distinct KV rows on the CPU; ``pad``: about 10% are -1."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(kv_slots, generator=g)[: n * page_tokens].reshape(n, page_tokens)
    if pad:
        rows[torch.rand(rows.shape, generator=g) < 0.1] = -1
    return rows.to(dtype)


def staging_bytes(staging):
    return {n: staging.tensor(n).clone() for n in staging.buffer_names}


def kv_bytes(kv):
    return {n: [kv.layer(n, i).to("cpu", copy=True) for i in range(kv.num_layers(n))]
            for n in kv.buffer_names}


def assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, list):
            for i, (p, q) in enumerate(zip(x, y, strict=True)):
                assert torch.equal(p, q), f"buffer {name} layer {i} differs"
        else:
            assert torch.equal(x, y), f"buffer {name} differs"


def compiled_kernels() -> int:
    """How many specialisations of the row-copy kernel are compiled (all devices)."""
    from kvmove.kernels import row_copy

    caches = row_copy._copy_rows_kernel.device_caches
    return sum(len(c[0]) for c in caches.values()) if caches else 0


_CYCLES_PER_S: list[float] = []


def _cycles_per_second() -> float:
    if not _CYCLES_PER_S:
        torch.cuda._sleep(10_000_000)  # the clocks up first
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_S.append(50_000_000 / (start.elapsed_time(end) / 1e3))
    return _CYCLES_PER_S[0]


class BusyDevice:
    """The current stream held busy for about ``seconds`` by a spinning kernel, and an event
    after it. A call made meanwhile that waits for the device (a host sync, a stream
    synchronize, an upload from pageable memory on a stream ordered after this work) returns
    only once the spin has ended: :meth:`still_busy` is then False. Work the call enqueues
    after the caller's stream runs after the spin, so bytes show ordering too."""

    def __init__(self, seconds: float = 1.0):
        rate = _cycles_per_second()
        torch.cuda._sleep(int(seconds * rate))
        self.done = torch.cuda.Event()
        self.done.record()

    def still_busy(self) -> bool:
        return not self.done.query()
