"""The row-copy kernels: the Triton kernel (through the interpreter) and the torch backend
give identical bytes, equal to an independent per-row reference, for hypothesis-generated
caches; padding, duplicates, layer subsets and out-of-range rows behave as documented."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from tests.support.caches import (
    assert_same,
    buffer_specs,
    build_cache,
    fill_random,
    snapshot,
    underlying,
)

BACKENDS = ["torch", "triton"]
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


pytestmark = pytest.mark.usefixtures("triton_interpreter")


@st.composite
def page_batches(draw, kv_slots, staging_slots, page_tokens):
    """(token_pages, slots), distinct staging slots. Each page is scattered, duplicate and
    -1 KV rows, or a whole aligned KV page (the paged-cache case, which the torch backend
    moves as one unit), or such a page cut short by -1 padding."""
    n = draw(st.integers(1, min(4, staging_slots)))
    token = st.one_of(st.integers(0, kv_slots - 1), st.just(-1))
    aligned_pages = kv_slots // page_tokens
    kinds = ["rows", "whole", "cut"] if aligned_pages and page_tokens > 1 else ["rows"]
    pages = []
    for _ in range(n):
        kind = draw(st.sampled_from(kinds))
        if kind == "rows":
            pages.append(draw(st.lists(token, min_size=page_tokens, max_size=page_tokens)))
            continue
        first = draw(st.integers(0, aligned_pages - 1)) * page_tokens
        keep = page_tokens if kind == "whole" else draw(st.integers(1, page_tokens - 1))
        pages.append([first + t if t < keep else -1 for t in range(page_tokens)])
    slots = draw(st.permutations(range(staging_slots)))[:n]
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return torch.tensor(pages, dtype=dtype), torch.tensor(slots, dtype=dtype)


def expected_gather(kv, before, token_pages, slots, page_tokens):
    """Per-row reference of a gather, written independently of kvmove's index maths."""
    out = {n: [t.clone() for t in layers] for n, layers in before.items()}
    for name in kv.buffer_names:
        rb = kv.row_bytes(name)
        for layer in range(kv.num_layers(name)):
            src = kv.layer(name, layer)
            for p, slot in enumerate(slots.tolist()):
                for t, row in enumerate(token_pages[p].tolist()):
                    if row >= 0:
                        out[name][layer][slot, t * rb:(t + 1) * rb] = src[row]
    return out


@pytest.mark.interpreter
@SETTINGS
@given(data=st.data(), specs=buffer_specs(),
       page_tokens=st.sampled_from([1, 2, 3, 5, 16, 64]), kv_slots=st.integers(4, 140))
def test_gather_backends_agree_with_reference(data, specs, page_tokens, kv_slots):
    kv = build_cache(specs, kv_slots, seed=data.draw(st.integers(0, 1000)))
    staging_slots = data.draw(st.integers(1, 6))
    token_pages, slots = data.draw(page_batches(kv_slots, staging_slots, page_tokens))
    results = []
    for backend in BACKENDS:
        staging = kvmove.StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens)
        fill_random(staging, seed=7)
        before = snapshot(staging)
        errors = kvmove.gather(kv, staging, token_pages, slots, backend=backend)
        assert int(errors) == 0
        results.append(snapshot(staging))
    assert_same(results[0], results[1])
    assert_same(results[0], expected_gather(kv, before, token_pages, slots, page_tokens))


@pytest.mark.interpreter
@SETTINGS
@given(data=st.data(), specs=buffer_specs(),
       page_tokens=st.sampled_from([1, 2, 4, 16, 64]), kv_slots=st.integers(4, 140))
def test_gather_then_scatter_into_other_slots_reproduces_rows(data, specs, page_tokens, kv_slots):
    kv = build_cache(specs, kv_slots, seed=1)
    staging_slots = data.draw(st.integers(1, 5))
    token_pages, slots = data.draw(page_batches(kv_slots, staging_slots, page_tokens))
    # Destination rows: distinct KV rows of another cache (scattered, or whole aligned
    # pages), -1 where the source was padding.
    n = token_pages.shape[0]
    aligned_pages = kv_slots // page_tokens
    if aligned_pages >= n and data.draw(st.booleans()):
        firsts = torch.tensor(data.draw(st.permutations(range(aligned_pages)))[:n])
        perm = (firsts[:, None] * page_tokens + torch.arange(page_tokens)).reshape(-1)
    else:
        perm = torch.tensor(data.draw(st.permutations(range(kv_slots))))
    needed = n * page_tokens
    if needed > kv_slots:
        perm = torch.cat([perm, torch.full((needed - kv_slots,), -1)])
    dst_pages = perm[:needed].reshape(n, page_tokens).to(token_pages.dtype)
    dst_pages[token_pages < 0] = -1
    layers = data.draw(st.one_of(st.none(), st.integers(0, kv.max_layers - 1)))
    results = []
    for backend in BACKENDS:
        staging = kvmove.StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens)
        kvmove.gather(kv, staging, token_pages, slots, backend=backend)
        other = build_cache(specs, kv_slots, seed=99)
        before = snapshot(other)
        errors = kvmove.scatter(staging, slots, other, dst_pages, layers=layers, backend=backend)
        assert int(errors) == 0
        after = snapshot(other)
        # Every named row holds the source row; every other row is bit-identical.
        expect = {k: [t.clone() for t in v] for k, v in before.items()}
        for name in kv.buffer_names:
            for layer in range(kv.num_layers(name)):
                if layers is not None and layer != layers:
                    continue
                for s_row, d_row in zip(token_pages.reshape(-1).tolist(),
                                        dst_pages.reshape(-1).tolist(), strict=True):
                    if d_row >= 0:
                        expect[name][layer][d_row] = kv.layer(name, layer)[s_row]
        assert_same(after, expect)
        results.append(after)
    assert_same(results[0], results[1])


@pytest.mark.interpreter
@SETTINGS
@given(data=st.data(), specs=buffer_specs(max_buffers=2, max_layers=3),
       kv_slots=st.integers(2, 30))
def test_copy_rows_kv_to_kv_backends_agree(data, specs, kv_slots):
    src = build_cache(specs, kv_slots, seed=3)
    n = data.draw(st.integers(0, kv_slots))
    src_rows = torch.tensor(data.draw(st.lists(st.integers(-1, kv_slots - 1), min_size=n,
                                               max_size=n)), dtype=torch.int64)
    dst_rows = torch.tensor(data.draw(st.permutations(range(kv_slots)))[:n], dtype=torch.int32)
    results = []
    for backend in (*BACKENDS, "two_hop"):
        dst = build_cache(specs, kv_slots, seed=4)
        kvmove.copy_rows(src, src_rows, dst, dst_rows, backend=backend)
        results.append(snapshot(dst))
    for other in results[1:]:
        assert_same(results[0], other)
    for name in src.buffer_names:
        for layer in range(src.num_layers(name)):
            for s, d in zip(src_rows.tolist(), dst_rows.tolist(), strict=True):
                if s >= 0:
                    assert torch.equal(results[0][name][layer][d], src.layer(name, layer)[s])


@pytest.mark.parametrize("backend", [*BACKENDS, "two_hop"])
def test_unchecked_out_of_range_rows_are_counted_and_never_written(backend):
    specs = [("kv", 3, 656, torch.uint8, 3, False), ("ix", 2, 132, torch.float32, 1, False)]
    kv = build_cache(specs, 16, seed=5)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    fill_random(staging, seed=1)
    # Gather with bad KV rows (16, 1000, -7) and a bad slot (9): skipped and counted.
    token_pages = torch.tensor([[0, 16, 1000, 2], [3, -7, -1, 4], [5, 6, 7, 8]])
    slots = torch.tensor([0, 1, 9])
    staging_before = snapshot(staging)
    errors = kvmove.gather(kv, staging, token_pages, slots, backend=backend, check=False)
    assert int(errors) == 3 + 4  # three bad KV rows, four rows of the bad slot
    after = snapshot(staging)
    for name in kv.buffer_names:
        rb = kv.row_bytes(name)
        for layer in range(kv.num_layers(name)):
            expect = staging_before[name][layer].clone()
            for slot, t, row in [(0, 0, 0), (0, 3, 2), (1, 0, 3), (1, 3, 4)]:
                expect[slot, t * rb:(t + 1) * rb] = kv.layer(name, layer)[row]
            assert torch.equal(after[name][layer], expect)
    # Scatter to out-of-range KV rows: nothing outside the cache (or between rows) changes.
    before = underlying(kv)
    errors = kvmove.scatter(staging, torch.tensor([0, 1]), kv,
                            torch.tensor([[16, 17, -3, 10**9], [-1, -1, -1, 99]]),
                            backend=backend, check=False)
    assert int(errors) == 5
    for x, y in zip(before, underlying(kv), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_accumulate_into_callers_counter(backend):
    kv = build_cache([("kv", 2, 132, torch.uint8, 0, True)], 8)
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=2)
    counter = torch.zeros(1, dtype=torch.int32)
    for _ in range(3):
        kvmove.gather(kv, staging, torch.tensor([[0, 8]]), torch.tensor([0]), backend=backend,
                      check=False, errors=counter)
    assert int(counter) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_subset_copies_only_those_layers(backend):
    specs = [("a", 4, 576, torch.bfloat16, 0, True), ("b", 2, 4, torch.float32, 0, False)]
    kv = build_cache(specs, 8, seed=2)
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=3)
    zero = snapshot(staging)
    kvmove.copy_rows(kv, torch.tensor([1, 2, 3]), staging, torch.tensor([0, 1, 2]),
                     layers=[3], backend=backend)
    after = snapshot(staging)
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            changed = not torch.equal(after[name][layer], zero[name][layer])
            assert changed == (name == "a" and layer == 3)


def test_auto_backend_is_torch_without_a_gpu():
    from kvmove.rows.prepared import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_within_one_pool_reads_before_it_writes(backend):
    """KV to KV inside one cache (a defragmentation) and staging to staging, whole pages and
    single rows: every destination gets its source row as it was before the call."""
    specs = [("kv", 2, 656, torch.uint8, 0, True), ("pad", 1, 132, torch.uint8, 4, False)]
    kv = build_cache(specs, 32, seed=8)
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=4)
    fill_random(staging, seed=3)
    for pool, src, dst in (
        (kv, [*range(8, 16), 30], [*range(0, 8), 29]),  # two whole pages and a row
        (staging, list(range(12, 20)), [4, 5, 6, 7, 0, 1, 2, 3]),  # pages; slots not a run
    ):
        rows = {name: [t.clone() for t in b.layers] for name, b in pool.row_pool.buffers.items()}
        kvmove.copy_rows(pool, torch.tensor(src), pool, torch.tensor(dst), backend=backend)
        for name, b in pool.row_pool.buffers.items():
            for layer, before in enumerate(rows[name]):
                expect = before.clone()
                expect[torch.tensor(dst)] = before[torch.tensor(src)]
                assert torch.equal(b.layers[layer], expect), (pool, name, layer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_tokens", [1, 4])
def test_consecutive_pages_to_consecutive_slots_and_back(backend, page_tokens):
    """KV pages that follow each other into slots that follow each other (the torch backend
    copies such a run in one call per layer), padded and odd rows, and back into other
    consecutive pages: every row lands where it belongs and nothing else changes."""
    specs = [("kv", 3, 656, torch.uint8, 0, True), ("pad", 2, 132, torch.uint8, 3, False),
             ("tiny", 1, 4, torch.float32, 1, False), ("bf", 2, 1152, torch.bfloat16, 0, False)]
    kv = build_cache(specs, 12 * page_tokens, seed=4)
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens)
    fill_random(staging, seed=5)
    before = snapshot(staging)
    pages = torch.arange(2, 5)[:, None] * page_tokens + torch.arange(page_tokens)
    slots = torch.tensor([1, 2, 3])
    assert int(kvmove.gather(kv, staging, pages, slots, backend=backend)) == 0
    assert_same(snapshot(staging), expected_gather(kv, before, pages, slots, page_tokens))
    other = build_cache(specs, 12 * page_tokens, seed=6)
    expect = snapshot(other)
    targets = pages + 5 * page_tokens  # pages 7, 8, 9
    for name in kv.buffer_names:
        for layer in range(kv.num_layers(name)):
            expect[name][layer][targets.reshape(-1)] = kv.layer(name, layer)[pages.reshape(-1)]
    assert int(kvmove.scatter(staging, slots, other, targets, backend=backend)) == 0
    assert_same(snapshot(other), expect)


def test_nan_bit_patterns_survive_the_wide_copies():
    """The torch backend copies aligned rows as complex128 / int64 elements: rows made of
    signalling and quiet NaN bit patterns (and negative zero) come back bit for bit."""
    patterns = torch.tensor([0x7FF0000000000001, 0x7FF8000000000000, -0x0008000000000001,
                             -0x8000000000000000, 0x7FF4000000000000, 1], dtype=torch.int64)
    rows = patterns.repeat(32 * 82 // len(patterns) + 1)[: 32 * 82].view(32, 82)
    kv = kvmove.KVCache({"kv": [rows.view(torch.uint8).view(32, 656).clone()]})
    assert kv.row_pool.buffers["kv"].widest_type(4).itemsize == 16
    staging = kvmove.StagingBuffer(kv, num_slots=3, page_tokens=4)
    pages = torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]])
    kvmove.gather(kv, staging, pages, torch.tensor([2, 0]), backend="torch")
    other = kvmove.KVCache({"kv": [torch.zeros(32, 656, dtype=torch.uint8)]})
    kvmove.scatter(staging, torch.tensor([2, 0]), other, pages + 16, backend="torch")
    copied, source = other.layer("kv", 0), kv.layer("kv", 0)
    assert torch.equal(copied[24:28], source[8:12]) and torch.equal(copied[16:20], source[0:4])


@pytest.mark.parametrize("layers", [None, 2, [0, 2], [0, 1, 3]])
@pytest.mark.parametrize("pad", [0, 24])
def test_stacked_caches_move_every_layer_in_one_view(layers, pad):
    """A cache given as one stacked tensor (rows padded or not) moves every selected layer
    through one 3-D view where the layers are evenly spaced, per layer where they are not:
    the bytes are the same either way."""
    g = torch.Generator().manual_seed(3)
    full = torch.randint(0, 256, (4, 96, 656 + pad), dtype=torch.uint8, generator=g)
    kv = kvmove.KVCache({"kv": full[:, :, :656]})
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=4)
    fill_random(staging, seed=5)
    chosen = range(4) if layers is None else ([layers] if isinstance(layers, int) else layers)
    evenly = len({b - a for a, b in zip(chosen, list(chosen)[1:], strict=False)}) <= 1
    view = kv.row_pool.buffers["kv"].stacked_units(tuple(chosen), 1, torch.uint8)
    assert (view is not None) == evenly  # the one-view path is taken where it can be
    # Consecutive pages into consecutive slots (run to run), scattered pages into a run,
    # and a scatter back to scattered rows (element-wise).
    kvmove.copy_rows(kv, torch.arange(8, 24), staging, torch.arange(0, 16), layers=layers)
    rows = torch.tensor([50, 3, 77, 12, 90, 61])
    kvmove.copy_rows(kv, rows, staging, torch.arange(16, 22), layers=layers)
    for layer in range(4):
        st = staging.tensor("kv")[layer].view(-1, 656)
        if layer in chosen:
            assert torch.equal(st[0:16], full[layer, 8:24, :656])
            assert torch.equal(st[16:22], full[layer, rows, :656])
    before = full.clone()
    back = torch.tensor([5, 40, 41, 88, 30, 31])
    kvmove.copy_rows(staging, torch.arange(16, 22), kv, back, layers=layers)
    for layer in range(4):
        want = before[layer].clone()
        if layer in chosen:
            want[back, :656] = before[layer, rows, :656]
        assert torch.equal(full[layer], want)  # the padding between rows untouched too


def test_a_new_destination_never_inherits_a_dropped_ones_element_type():
    # The element type a copy moves in suits both sides. A destination of 16-byte-aligned
    # padded rows moves in 16-byte words; once it is gone, a new one at an odd address (only
    # bytes tile it) may get the same Python id: its copies must still move bytes.
    src = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 64, 16), dtype=torch.uint8)})
    rows = torch.arange(0, 8)

    def padded_rows(offset: int) -> kvmove.KVCache:  # pitch 32, rows of 16, at ``offset``
        raw = torch.zeros(2, 64 * 32 + 32, dtype=torch.uint8)
        return kvmove.KVCache({"kv": [raw[i, offset:offset + 64 * 32].view(64, 32)[:, :16]
                                      for i in range(2)]})

    for _ in range(200):  # CPython reuses an address within tens of rounds here
        aligned = padded_rows(0)
        kvmove.copy_rows(src, rows, aligned, rows, backend="torch")
        del aligned
        src.row_pool.prepared.clear()  # as the prepared copies' LRU drops it in time
        odd = padded_rows(1)
        kvmove.copy_rows(src, rows, odd, rows, backend="torch")
        for layer in range(2):
            assert torch.equal(odd.layer("kv", layer)[rows], src.layer("kv", layer)[rows])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scatter_of_no_layer_counts_only_the_bad_rows(backend):
    """A copy that selects no layer copies nothing but still counts out-of-range rows, each
    index against its own pool (KV rows against the cache, staging rows against the
    staging): whole valid pages count nothing."""
    kv = kvmove.KVCache({"kv": torch.randint(0, 255, (2, 64, 16), dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4)
    before = kv.layer("kv", 0).clone()
    pages = torch.tensor([[20, 21, 22, 23], [40, 41, 42, 43]])
    errors = kvmove.scatter(staging, [0, 1], kv, pages, layers=[], backend=backend)
    assert int(errors) == 0
    errors = kvmove.scatter(staging, [0, 1], kv, torch.tensor([[20, 21, 22, 64], [40, 41, -1, 43]]),
                            layers=[], backend=backend, check=False)
    assert int(errors) == 1
    errors = kvmove.gather(kv, staging, pages, [1, 2], backend=backend, check=False)
    assert int(errors) == 4  # slot 2 of 2: its four rows
    assert torch.equal(kv.layer("kv", 0), before)
