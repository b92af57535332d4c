"""Prepared copies (kvmove/rows/prepared.py) on their own: what is worked out once (layers,
backends, limits, the pools' geometry), the cache that hands the same copy back, and
``PreparedCopy.run`` with its contract (-1 skips, out-of-range rows counted and never
written), its bytes compared with a plain per-row reference, Triton (interpreter) and
torch alike, on per-layer and stacked caches, every path the torch backend takes."""

from __future__ import annotations

import enum
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.prepared import (
    PREPARED_KEPT,
    PreparedCopy,
    prepared_copy,
    resolve_backend,
    select_layers,
)
from kvmove.rows.torch_backend import reference as torch_backend
from tests.support.caches import assert_same, buffer_specs, build_cache, fill_random, snapshot

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def world(page_tokens=4, num_slots=6, kv_slots=32):
    specs = [("kv", 3, 656, torch.uint8, 0, True), ("ix", 2, 132, torch.float32, 1, False)]
    kv = build_cache(specs, kv_slots, seed=1)
    return kv, kvmove.StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens)


def test_backend_and_layers_are_resolved_once():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("two_hop", torch.device("cpu")) == "two_hop"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", torch.device("cpu"))
    kv, _ = world()
    pool = kv.row_pool
    assert select_layers(pool, None) == {"kv": (0, 1, 2), "ix": (0, 1)}
    assert select_layers(pool, 2) == {"kv": (2,), "ix": ()}  # ix has no layer 2
    assert select_layers(pool, [2, 0]) == {"kv": (2, 0), "ix": (0,)}
    for bad, error in ((3, IndexError), (-1, IndexError), (True, TypeError), ("0", TypeError),
                       ([0, 0], ValueError), ([0.5], TypeError)):
        with pytest.raises(error):
            select_layers(pool, bad)


def test_a_prepared_copy_knows_its_pools():
    kv, staging = world(page_tokens=4, num_slots=6, kv_slots=32)
    gather = prepared_copy(kv.row_pool, staging.row_pool, direction="gather", page_tokens=4)
    assert gather.gathering and gather.torch_only and gather.device == torch.device("cpu")
    assert (gather.kv_rows, gather.staging_slots) == (32, 6)
    assert (gather.src_rows_limit, gather.dst_rows_limit) == (32, 24)
    assert [p.layers for p in gather.parts] == [(0, 1, 2), (0, 1)]
    scatter = prepared_copy(staging.row_pool, kv.row_pool, 2, direction="scatter",
                            page_tokens=4)
    assert not scatter.gathering and (scatter.kv_rows, scatter.staging_slots) == (32, 6)
    assert [p.layers for p in scatter.parts] == [(2,)]  # ix has no layer 2: no part


def test_the_cache_hands_the_same_copy_back_and_keeps_the_latest():
    kv, staging = world()
    pools = kv.row_pool, staging.row_pool
    first = prepared_copy(*pools, direction="gather", page_tokens=4)
    assert prepared_copy(*pools, direction="gather", page_tokens=4) is first
    assert prepared_copy(*pools, backend="torch", direction="gather", page_tokens=4) \
        is not first  # another backend name is another entry
    per_layer = [prepared_copy(*pools[::-1], layer, direction="scatter", page_tokens=4)
                 for layer in range(3)]
    assert prepared_copy(*pools[::-1], [1], direction="scatter", page_tokens=4) \
        is not per_layer[1]  # a sequence of layers is its own key
    assert prepared_copy(*pools[::-1], 1, direction="scatter", page_tokens=4) is per_layer[1]
    # More geometries than the cache keeps: the least recently used are dropped.
    others = [build_cache([("kv", 3, 656, torch.uint8, 0, True),
                           ("ix", 2, 132, torch.float32, 1, False)], 8)
              for _ in range(PREPARED_KEPT)]
    prepared_copy(*pools, direction="gather", page_tokens=4)  # the most recent: kept
    for other in others:
        prepared_copy(other.row_pool, staging.row_pool, direction="gather", page_tokens=4)
    assert len(staging.row_pool.prepared) <= PREPARED_KEPT
    assert prepared_copy(*pools, direction="gather", page_tokens=4) is not first


def test_pools_of_another_geometry_are_refused_and_nothing_is_cached():
    _, staging = world()
    other = build_cache([("kv", 2, 656, torch.uint8, 0, True)], 32)
    before = len(staging.row_pool.prepared)
    with pytest.raises(ValueError, match="geometry"):
        prepared_copy(other.row_pool, staging.row_pool, direction="gather", page_tokens=4)
    assert len(staging.row_pool.prepared) == before


def test_threads_share_the_cache():
    kv, staging = world()
    found, errors = [], []

    def work():
        try:
            for layer in (0, 1, 2) * 200:
                found.append(prepared_copy(staging.row_pool, kv.row_pool, layer,
                                           direction="scatter", page_tokens=4))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert {p.parts[0].layers for p in found} == {(0,), (1,), (2,)}
    latest = [prepared_copy(staging.row_pool, kv.row_pool, layer, direction="scatter",
                            page_tokens=4) for layer in range(3)]
    assert all(isinstance(p, PreparedCopy) for p in latest)


def reference_copy(src, src_rows, dst, dst_rows, layers, before):
    """Row by row: ``dst[d] = src[s]`` in each chosen layer, skipping -1 and rows out of
    range on either side; the number of out-of-range rows."""
    out = {n: [t.clone() for t in ts] for n, ts in before.items()}
    errors = 0
    for s, d in zip(src_rows, dst_rows, strict=True):
        bad = not -1 <= s < src.row_pool_rows or not -1 <= d < dst.row_pool_rows
        errors += bad
        if bad or s < 0 or d < 0:
            continue
        for name, chosen in layers.items():
            for layer in chosen:
                out[name][layer][d] = src.rows[name][layer][s]
    return out, errors


class Rows:
    """A pool's rows as plain tensors (a snapshot), for the reference."""

    def __init__(self, pool):
        self.rows = {n: [b.layers[i].clone() for i in range(b.num_layers)]
                     for n, b in pool.row_pool.buffers.items()}
        self.row_pool_rows = next(iter(pool.row_pool.buffers.values())).num_rows


def rows_snapshot(pool):
    return {n: [t.clone() for t in b.layers] for n, b in pool.row_pool.buffers.items()}


@pytest.mark.interpreter
@SETTINGS
@given(data=st.data(), specs=buffer_specs(max_buffers=2, max_layers=4),
       page_tokens=st.sampled_from([1, 2, 4, 16]), kv_slots=st.integers(8, 80),
       small_paths=st.booleans())
def test_run_copies_the_rows_it_is_given(data, specs, page_tokens, kv_slots, small_paths):
    """``PreparedCopy.run`` unchecked, KV -> staging and back, whole pages in and out of
    order, runs, scattered rows, -1 and out-of-range rows: every backend writes exactly the
    reference's bytes and counts the same bad rows. ``small_paths`` moves the torch
    backend's thresholds to 0, so that its other paths (torch copies of runs, one call per
    layer) give the same bytes."""
    with pytest.MonkeyPatch.context() as patch:
        if small_paths:
            patch.setattr(torch_backend, "MEMMOVE_MAX_BYTES", 0)
            patch.setattr(torch_backend, "STACKED_SELECT_MAX_BYTES", 0)
            patch.setattr(torch_backend, "SERIAL_SELECT_MAX_BYTES", 0)
        check_run_copies(data, specs, page_tokens, kv_slots)


def check_run_copies(data, specs, page_tokens, kv_slots):
    kv = build_cache(specs, kv_slots, seed=data.draw(st.integers(0, 99)))
    num_slots = data.draw(st.integers(1, 6))
    staging_rows = num_slots * page_tokens
    n = data.draw(st.integers(0, min(num_slots, kv_slots // page_tokens)))
    kind = data.draw(st.sampled_from(["run", "pages", "pages into a run", "rows"]))
    slot0 = data.draw(st.integers(0, num_slots - n))
    if kind == "run":  # consecutive KV pages into consecutive slots
        first = data.draw(st.integers(0, kv_slots // page_tokens - n))
        kv_rows = list(range(first * page_tokens, (first + n) * page_tokens))
        st_rows = list(range(slot0 * page_tokens, (slot0 + n) * page_tokens))
    elif kind.startswith("pages"):  # whole pages in any order (into slots that follow)
        pages = data.draw(st.permutations(range(kv_slots // page_tokens)))[:n]
        slots = (list(range(slot0, slot0 + n)) if kind.endswith("run")
                 else data.draw(st.permutations(range(num_slots)))[:n])
        kv_rows = [p * page_tokens + t for p in pages for t in range(page_tokens)]
        st_rows = [s * page_tokens + t for s in slots for t in range(page_tokens)]
    else:  # any rows, -1 and out of range included
        m = data.draw(st.integers(0, staging_rows))
        kv_rows = data.draw(st.lists(st.integers(-2, kv_slots + 2), min_size=m, max_size=m))
        st_rows = data.draw(st.permutations([*range(staging_rows), *[-1] * m]))[:m]
    layers = data.draw(st.one_of(st.none(), st.integers(0, kv.max_layers - 1)))
    results = []
    for backend in ("torch", "triton"):
        staging = kvmove.StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens)
        fill_random(staging, seed=3)
        before = rows_snapshot(staging)
        gather = prepared_copy(kv.row_pool, staging.row_pool, layers, backend=backend,
                               direction="gather", page_tokens=page_tokens)
        errors = torch.zeros(1, dtype=torch.int32)
        gather.run(torch.tensor(kv_rows, dtype=torch.int64),
                   torch.tensor(st_rows, dtype=torch.int32), errors)
        chosen = {part.src.name: part.layers for part in gather.parts}
        want, bad = reference_copy(Rows(kv), kv_rows, Rows(staging), st_rows, chosen, before)
        assert int(errors) == bad, backend
        assert_same(rows_snapshot(staging), want)
        # Back into another cache, to the same rows: the scatter direction.
        other = build_cache(specs, kv_slots, seed=77)
        before_kv = rows_snapshot(other)
        scatter = prepared_copy(staging.row_pool, other.row_pool, layers, backend=backend,
                                direction="scatter", page_tokens=page_tokens)
        errors = torch.zeros(1, dtype=torch.int32)
        back = [r if 0 <= r < kv_slots else -1 for r in kv_rows]  # rows named once
        back = [r if back.index(r) == i else -1 for i, r in enumerate(back)]
        scatter.run(torch.tensor(st_rows, dtype=torch.int64), torch.tensor(back), errors)
        want, bad = reference_copy(Rows(staging), st_rows, Rows(other), back, chosen, before_kv)
        assert int(errors) == bad, backend
        assert_same(rows_snapshot(other), want)
        results.append((snapshot(staging), snapshot(other)))
    for a, b in zip(*results, strict=True):
        assert_same(a, b)


def test_a_run_is_bounded_whatever_the_caller_checked():
    """The host run copy (a memmove per layer) refuses a run that leaves either pool,
    before it writes: a memmove has no view to stop it."""
    from kvmove.rows.plan import Part

    kv, staging = world(page_tokens=4, num_slots=2, kv_slots=16)
    src, dst = kv.row_pool.buffers["kv"], staging.row_pool.buffers["kv"]
    before = snapshot(staging)
    for s0, d0, m in ((0, 1, 2), (3, 0, 2), (-1, 0, 1), (0, -1, 1)):
        part = Part(list(range(s0, s0 + m)), list(range(d0, d0 + m)))
        with pytest.raises(IndexError, match="leaves the pools"):
            torch_backend._copy_part(src, dst, (0, 1, 2), 4, part)
    assert_same(before, snapshot(staging))
    torch_backend._copy_part(src, dst, (1,), 4, Part([3], [1]))  # KV rows 12..15 -> slot 1
    assert torch.equal(staging.tensor("kv")[1, 1].view(4, 656), kv.layer("kv", 1)[12:16])
    assert torch.equal(staging.tensor("kv")[0], before["kv"][0])  # layer 0 untouched


@pytest.mark.parametrize("cache", ["stacked", "per_layer", "padded"])
@pytest.mark.parametrize("pattern", ["run to run", "pages to run", "run to pages",
                                     "pages to pages"])
@pytest.mark.parametrize("thresholds", ["as shipped", "zero"])
@pytest.mark.parametrize("page_tokens", [1, 4])
def test_every_torch_path_moves_the_same_bytes(cache, pattern, thresholds, page_tokens,
                                               monkeypatch):
    """Each way the torch backend moves pages (a memmove per layer, a copy of a stacked run,
    one index_select or index_copy_ for every layer, one per layer) on a stacked cache, on
    per-layer tensors and on padded rows: KV -> staging -> another cache, the bytes of a
    plain per-row copy."""
    if thresholds == "zero":
        monkeypatch.setattr(torch_backend, "MEMMOVE_MAX_BYTES", 0)
        monkeypatch.setattr(torch_backend, "STACKED_SELECT_MAX_BYTES", 0)
        monkeypatch.setattr(torch_backend, "SERIAL_SELECT_MAX_BYTES", 0)
    spec = {"stacked": (0, True), "per_layer": (0, False), "padded": (3, False)}[cache]
    specs = [("kv", 3, 656, torch.uint8, *spec), ("ix", 2, 132, torch.float32, *spec)]
    kv = build_cache(specs, 12 * page_tokens, seed=4)
    staging = kvmove.StagingBuffer(kv, num_slots=6, page_tokens=page_tokens)
    fill_random(staging, seed=5)
    pages = [2, 3, 4] if pattern.startswith("run") else [7, 2, 5]
    slots = [1, 2, 3] if pattern.endswith("run") else [4, 0, 2]
    targets = [8, 9, 10] if pattern.endswith("run") else [9, 0, 6]  # scatter: into these

    def rows(numbers):
        return [n * page_tokens + t for n in numbers for t in range(page_tokens)]

    for src, dst, src_rows, dst_rows, direction in (
            (kv, staging, rows(pages), rows(slots), "gather"),
            (staging, kv, rows(slots), rows(targets), "scatter")):
        before = rows_snapshot(dst)
        want, bad = reference_copy(Rows(src), src_rows, Rows(dst), dst_rows,
                                   dict(src.row_pool.all_layers), before)
        prepared = prepared_copy(src.row_pool, dst.row_pool, direction=direction,
                                 page_tokens=page_tokens)
        prepared.run(torch.tensor(src_rows), torch.tensor(dst_rows), None)
        assert bad == 0
        assert_same(rows_snapshot(dst), want)


@pytest.mark.parametrize(("bad", "good"), [(True, 1), ([1.0], [1]), ([np.int64(1)], [1]),
                                          ([False], [0]), ((True,), (1,))])
def test_a_cached_copy_never_lets_a_bad_layers_argument_through(bad, good):
    kv, staging = world()
    pools = kv.row_pool, staging.row_pool

    def copy(layers):
        return prepared_copy(*pools, layers, direction="gather", page_tokens=4)

    with pytest.raises(TypeError, match="layers"):
        copy(bad)
    copy(good)  # cached under a key equal to the bad argument's
    with pytest.raises(TypeError, match="layers"):
        copy(bad)


def test_layers_of_int_subclasses_are_keyed_as_their_ints():
    kv, staging = world()
    pools = kv.row_pool, staging.row_pool
    Layer = enum.IntEnum("Layer", {"FIRST": 0, "SECOND": 1})
    copy = prepared_copy(*pools, [Layer.SECOND], direction="gather", page_tokens=4)
    assert copy is prepared_copy(*pools, [1], direction="gather", page_tokens=4)
    assert copy.parts[0].layers == (1,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_copy_of_no_layers_still_counts_out_of_range_rows(backend):
    kv, _ = world()
    before = snapshot(kv)
    copy = prepared_copy(kv.row_pool, kv.row_pool, [], backend=backend, direction="gather",
                         page_tokens=4)
    errors = torch.zeros(1, dtype=torch.int32)
    copy.run(torch.tensor([99, 0, -1, -7]), torch.tensor([1, 40, 2, 3]), errors)
    assert errors.item() == 3  # 99, 40 and -7; -1 skips
    assert_same(before, snapshot(kv))
    assert int(kvmove.copy_rows(kv, [99], kv, [1], layers=[], backend=backend,
                                check=False)) == 1
