"""On a CUDA GPU (skipped elsewhere): the compiled Triton kernel against the torch backend
with the KV on the GPU and pinned, device-accessible staging; the error counter with
``check=False``; the two-hop path (batched and per-span copy-engine copies, default and
side streams, a ring small enough to chunk) against the direct kernel; tuning on first use
and the recorded path behind ``backend="auto"``. ``bench/gpu_check.sh`` runs these."""

from __future__ import annotations

import json

import pytest
import torch

import kvmove

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch, tmp_path):
    """The real Triton compiler (never the interpreter), a private tuning cache."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVMOVE_AUTOTUNE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from kvmove.rows import launch_config

    launch_config.reset()
    yield
    launch_config.reset()


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


def random_pages(kv_slots, n, page_tokens, *, dtype=torch.int64, pad=True, seed=0):
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


def test_the_kernel_is_compiled_not_interpreted():
    from kvmove.kernels import copy_rows
    from triton.runtime.interpreter import InterpretedFunction

    assert not isinstance(copy_rows._copy_rows_kernel, InterpretedFunction), (
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


def build(buffers, slots, seed=0):
    return kvmove.KVCache({name: cuda_layers(layers, slots, rb, dt, pad=pad, seed=seed + i)
                           for i, (name, layers, rb, dt, pad) in enumerate(buffers)})


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
        with torch.cuda.stream(stream):
            kvmove.gather(kv, staging, token_pages, slots, backend=backend)
            kvmove.scatter(staging, slots, other, dst, backend=backend)
        torch.cuda.synchronize()
        out += [staging_bytes(staging), kv_bytes(other)]
    assert_equal(out[0], out[2])
    assert_equal(out[1], out[3])


def test_copy_engine_spans_on_a_side_stream():
    from kvmove.rows.copy_engine import copy_spans, cuda_copier

    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=CUDA)
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    starts = list(range(0, 1 << 20, 1 << 16))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        calls = copy_spans([host.data_ptr() + s for s in starts],
                           [src.data_ptr() + s for s in starts], [1 << 15] * len(starts),
                           device=CUDA, src_on_device=True, batch=True)
    stream.synchronize()
    print(f"cuMemcpyBatchAsync available: {cuda_copier().has_batch}; {calls} call(s) "
          f"for {len(starts)} spans")
    expect = torch.zeros_like(host)
    cpu = src.cpu()
    for s in starts:
        expect[s:s + (1 << 15)] = cpu[s:s + (1 << 15)]
    assert torch.equal(host, expect)


@pytest.mark.parametrize("batch", [True, False])
def test_copy_engine_grid_covers_every_layer(batch):
    from kvmove.rows.copy_engine import copy_span_grid

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
    if not batch:
        assert calls == len(starts)  # one 2-D copy per span, covering every layer


def test_tune_key_finds_a_valid_config():
    from kvmove.tuning.config_search import valid
    from kvmove.tuning.key_tuning import tune_key

    r = tune_key(CUDA, "gather", 656, 64, quick=True, target_bytes=16 << 20)
    assert valid(r.config, 656, 16)
    assert r.config_gbps > 0 and r.config_gbps >= 0.9 * r.default_gbps
    assert r.path in ("direct", "two_hop")


def test_autotune_on_first_use_fills_the_user_cache(monkeypatch):
    from kvmove.rows import launch_config as tuning

    monkeypatch.setenv("KVMOVE_AUTOTUNE", "1")
    kv = build([("kv", 2, 132, torch.uint8, 0)], 256)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    kvmove.gather(kv, staging, torch.tensor([[5], [6]]), torch.tensor([0, 1]),
                  backend="triton")
    torch.cuda.synchronize()
    path = tuning.cache_path(torch.cuda.get_device_name())
    data = json.loads(path.read_text())
    assert "gather/tiny/p1" in data["configs"]
    assert torch.equal(staging.tensor("kv")[0, 0], kv.layer("kv", 0)[5].cpu())


def test_auto_uses_the_two_hop_path_where_recorded(monkeypatch):
    from kvmove.rows import launch_config as tuning
    from kvmove.rows import two_hop

    path = tuning.cache_path(torch.cuda.get_device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"configs": {}, "paths": {"gather/small/p16": "two_hop"}}))
    calls = []
    real = two_hop.copy_rows_two_hop
    monkeypatch.setattr(two_hop, "copy_rows_two_hop",
                        lambda *a, **k: (calls.append(1), real(*a, **k)))
    kv = build([("kv", 3, 656, torch.uint8, 0)], 256)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    token_pages = random_pages(256, 3, 16)
    kvmove.gather(kv, staging, token_pages, torch.tensor([2, 0, 1]))  # auto
    torch.cuda.synchronize()
    assert calls, "backend='auto' did not take the recorded two-hop path"
    reference = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    kvmove.gather(kv, reference, token_pages, torch.tensor([2, 0, 1]), backend="torch")
    for layer in range(3):
        for slot in (0, 1, 2):
            assert torch.equal(staging.tensor("kv")[layer, slot],
                               reference.tensor("kv")[layer, slot])
