"""Builders and hypothesis strategies of KV caches for the tests: several buffers, odd row
sizes, every dtype torch has, padded row pitches, stacked or per-layer tensors."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

import kvmove

ROW_BYTES = (4, 132, 576, 656, 1152, 4100)
DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def random_bytes(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (any bit pattern, NaNs included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def make_layers(num_layers, num_slots, row_bytes, dtype, *, pitch_pad=0, stacked=False, seed=0):
    """Per-layer tensors ``[num_slots, 1, row_bytes / itemsize]`` of random bytes. With
    ``pitch_pad`` > 0 each row is followed by that many unused elements (pitch > row)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    elems = row_bytes // itemsize
    if stacked and not pitch_pad:
        return random_bytes((num_layers, num_slots, 1, elems), dtype, g)
    layers = []
    for _ in range(num_layers):
        full = random_bytes((num_slots, 1, elems + pitch_pad), dtype, g)
        layers.append(full[:, :, :elems])
    return layers


def snapshot(pool) -> dict[str, list[torch.Tensor]]:
    """A copy of every byte of a KVCache or StagingBuffer, per buffer and layer."""
    if isinstance(pool, kvmove.StagingBuffer):
        return {n: [pool.tensor(n)[i].clone() for i in range(pool.num_layers(n))]
                for n in pool.buffer_names}
    return {n: [pool.layer(n, i).clone() for i in range(pool.num_layers(n))]
            for n in pool.buffer_names}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for i, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            assert torch.equal(x, y), f"buffer {name!r} layer {i} differs"


@st.composite
def buffer_specs(draw, max_buffers=3, max_layers=8):
    """[(name, layers, row_bytes, dtype, pitch_pad, stacked)] for 1..max_buffers buffers."""
    n = draw(st.integers(1, max_buffers))
    specs = []
    for i in range(n):
        row_bytes = draw(st.sampled_from(ROW_BYTES))
        dtype = draw(st.sampled_from(
            [d for d in DTYPES if row_bytes % torch.empty((), dtype=d).element_size() == 0]))
        specs.append((f"b{i}", draw(st.integers(1, max_layers)), row_bytes, dtype,
                      draw(st.sampled_from([0, 0, 1, 3])), draw(st.booleans())))
    return specs


def build_cache(specs, num_slots, seed=0) -> kvmove.KVCache:
    return kvmove.KVCache({
        name: make_layers(layers, num_slots, rb, dt, pitch_pad=pad, stacked=stk, seed=seed + i)
        for i, (name, layers, rb, dt, pad, stk) in enumerate(specs)
    })


def fill_random(staging: kvmove.StagingBuffer, seed: int) -> None:
    """Fill every staging tensor with random bytes (so that untouched rows are checkable)."""
    g = torch.Generator().manual_seed(seed)
    for name in staging.buffer_names:
        t = staging.tensor(name)
        t.copy_(random_bytes(t.shape, torch.uint8, g))


def write_random(kv: kvmove.KVCache, rows: torch.Tensor, gen: torch.Generator) -> None:
    """New random bytes in ``rows`` of every buffer and layer of ``kv``."""
    for n in kv.buffer_names:
        for layer in range(kv.num_layers(n)):
            t = kv.layer(n, layer)
            raw = torch.randint(0, 256, (len(rows), kv.row_bytes(n)), dtype=torch.uint8,
                                generator=gen)
            t[rows] = raw.view(t.dtype).view(len(rows), *t.shape[1:])


def underlying(kv: kvmove.KVCache) -> list[torch.Tensor]:
    """A copy of every tensor whose memory the cache views, padding between rows included."""
    out = []
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            t = kv.layer(name, layer)
            out.append((t._base if t._base is not None else t).clone())
    return out


# Buffers of an MLA-like, an MHA and a hybrid cache of ``slots`` token slots (stacked and
# per-layer tensors, odd dtypes, a padded pitch), for the movers' tests.
GEOMETRIES = {
    "mla": lambda slots: {"kv": make_layers(4, slots, 656, torch.uint8, stacked=True, seed=1)},
    "mha": lambda slots: {"k": make_layers(3, slots, 576, torch.bfloat16, seed=2),
                          "v": make_layers(3, slots, 576, torch.bfloat16, seed=3)},
    "hybrid": lambda slots: {"kv": make_layers(5, slots, 1152, torch.bfloat16, seed=4),
                             "indexer": make_layers(2, slots, 132, torch.uint8, pitch_pad=4,
                                                    seed=5)},
}
