"""Row pools (kvmove/memory/row_pool.py) on their own: every view a pool hands out (unit
views, stacked views, runs, in wide element types) holds exactly the bytes of the rows it
names, addresses are the layers' own, and what cannot be viewed is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.memory.row_pool import BufferRows, RowPool, byte_rows, shared_wide_type
from tests.support.caches import random_bytes

SETTINGS = settings(max_examples=40, deadline=None)


def rows_of(buffer: BufferRows, layer: int, first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count - 1`` of one layer, as plain bytes (the reference)."""
    return buffer.layers[layer][first:first + count].reshape(-1)


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.contiguous().view(torch.uint8).reshape(-1)


@st.composite
def buffers(draw):
    """A buffer's rows as an engine gives them: stacked or per layer, padded or not, at an
    offset into its storage or not."""
    layers = draw(st.integers(1, 5))
    rows = draw(st.integers(4, 40))
    row_bytes = draw(st.sampled_from([4, 132, 576, 656, 1152, 4100]))
    pad = draw(st.sampled_from([0, 0, 4, 16]))
    offset = draw(st.sampled_from([0, 0, 1, 4]))  # elements of uint8 before the first row
    stacked = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    if stacked:
        storage = random_bytes((offset + layers * rows * (row_bytes + pad),), torch.uint8, g)
        full = storage[offset:].view(layers, rows, row_bytes + pad)
        tensors = full[:, :, :row_bytes]
    else:
        tensors = []
        for _ in range(layers):
            storage = random_bytes((offset + rows * (row_bytes + pad),), torch.uint8, g)
            tensors.append(storage[offset:].view(rows, row_bytes + pad)[:, :row_bytes])
    kv = kvmove.KVCache({"b": tensors})
    return kv.row_pool.buffers["b"], stacked, pad


def test_byte_rows_views_rows_and_refuses_what_is_not_a_row():
    t = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    rows = byte_rows(t)
    assert rows.shape == (4, 24) and rows.dtype == torch.uint8
    assert rows.data_ptr() == t.data_ptr()  # a view, not a copy
    assert torch.equal(rows[2], t[2].reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        byte_rows(t.transpose(1, 2))
    with pytest.raises(ValueError, match="empty"):
        byte_rows(torch.zeros(4, 0))


@SETTINGS
@given(spec=buffers())
def test_units_and_runs_hold_the_rows_they_name(spec):
    buffer, stacked, pad = spec
    n = buffer.num_rows
    assert buffer.dense == (pad == 0) and buffer.on_host
    assert buffer.host_bases == tuple(t.data_ptr() for t in buffer.layers)
    for unit in (1, 2, 3):
        if unit > 1 and pad:
            with pytest.raises(ValueError, match="padded rows"):
                buffer.unit_views(unit)
            continue
        wide = buffer.widest_type(unit)
        units = n // unit
        for dtype in {torch.uint8, wide}:
            views = buffer.unit_views(unit, dtype)
            assert views is buffer.unit_views(unit, dtype)  # made once
            for layer, v in enumerate(views):
                assert v.shape[0] == units and v.dtype == dtype
                assert torch.equal(as_bytes(v), rows_of(buffer, layer, 0, units * unit))
            for start, count in ((0, units), (units - 1, 1), (units // 2, units - units // 2)):
                run = buffer.run_views(unit, start, count, dtype)
                for layer, v in enumerate(run):
                    assert torch.equal(as_bytes(v), rows_of(buffer, layer, start * unit,
                                                            count * unit))
        layers = tuple(range(buffer.num_layers))
        stacked_view = buffer.stacked_units(layers, unit, wide)
        # One view of every layer exists where the layers lie evenly in one storage.
        assert (stacked_view is not None) == (stacked or buffer.num_layers == 1)
        if stacked_view is not None:
            for layer in layers:
                assert torch.equal(as_bytes(stacked_view[layer]),
                                   rows_of(buffer, layer, 0, units * unit))
            run = buffer.stacked_run(layers, unit, 1, units - 1, wide)
            assert buffer.stacked_run(layers, unit, 1, units - 1, wide) is run  # kept
            for layer in layers:
                assert torch.equal(as_bytes(run[layer]),
                                   rows_of(buffer, layer, unit, (units - 1) * unit))


def test_widest_type_follows_row_size_pitch_and_base():
    def buffer(row_bytes, *, offset=0, pad=0):
        storage = torch.zeros(offset + 8 * (row_bytes + pad), dtype=torch.uint8)
        view = storage[offset:].view(8, row_bytes + pad)[:, :row_bytes]
        return kvmove.KVCache({"b": [view]}).row_pool.buffers["b"]

    assert buffer(656).widest_type(1) == torch.complex128  # 656 = 41 x 16
    assert buffer(132).widest_type(1) == torch.int32  # 132 = 33 x 4
    assert buffer(132).widest_type(4) == torch.complex128  # units of 528 bytes
    assert buffer(656, offset=8).widest_type(1) == torch.int64  # base 8 bytes in
    assert buffer(656, offset=1).widest_type(1) == torch.uint8
    assert buffer(656, pad=2).widest_type(1) == torch.int16  # pitch 658
    a, b = buffer(656), buffer(656, offset=4)
    assert shared_wide_type(a, b, 1) == torch.int32 == shared_wide_type(b, a, 1)


def test_layers_in_no_even_order_have_no_stacked_view():
    full = torch.zeros(4, 16, 64, dtype=torch.uint8)
    rows = kvmove.KVCache({"b": full}).row_pool.buffers["b"]
    assert rows.stacked_units((0, 1, 3), 1, torch.uint8) is None  # steps 1 and 2
    assert rows.stacked_units((0, 2), 1, torch.uint8) is not None  # every other layer
    assert rows.stacked_units((3, 1), 1, torch.uint8) is None  # descending: no view
    reordered = kvmove.KVCache({"b": [full[1], full[0]]}).row_pool.buffers["b"]
    assert reordered.stacked_units((0, 1), 1, torch.uint8) is None
    # Layers that overlap (a view repeated) cannot be one 3-D view either.
    twice = kvmove.KVCache({"b": [full[0], full[0]]}).row_pool.buffers["b"]
    assert twice.stacked_units((0, 1), 1, torch.uint8) is None


def test_runs_past_the_pool_are_refused():
    rows = kvmove.KVCache({"b": torch.zeros(2, 10, 16, dtype=torch.uint8)}).row_pool.buffers["b"]
    for start, count in ((9, 2), (-1, 1), (0, 11)):
        with pytest.raises(IndexError):
            rows.stacked_run((0, 1), 1, start, count, torch.uint8)
        with pytest.raises(IndexError):
            rows.run_views(1, start, count)


def test_host_addresses_are_refused_for_device_memory():
    layer = torch.zeros(4, 8, dtype=torch.uint8)
    on_device = BufferRows(name="d", layers=(layer,), row_bytes=8, pitch=8, num_rows=4,
                           device=torch.device("cuda", 0), dtype=torch.uint8, row_shape=(8,),
                           device_addresses=(layer.data_ptr(),))
    assert not on_device.on_host
    with pytest.raises(ValueError, match="not on the host"):
        on_device.host_bases  # noqa: B018 - the property raises


def test_row_pool_geometry():
    kv = kvmove.KVCache({"kv": torch.zeros(3, 8, 656, dtype=torch.uint8),
                         "ix": [torch.zeros(8, 33, dtype=torch.float32)]})
    pool: RowPool = kv.row_pool
    assert pool.buffer_names == ["kv", "ix"]
    assert pool.shape == {"kv": (3, 656), "ix": (1, 132)}
    assert pool.geometry() == [("kv", 3, 656), ("ix", 1, 132)]
    assert dict(pool.all_layers) == {"kv": (0, 1, 2), "ix": (0,)}
    assert pool.device == torch.device("cpu") and pool.kind == "KVCache"
    staging = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4)
    sp = staging.row_pool.buffers["kv"]
    assert sp.num_rows == 8 and sp.pitch == 656 and sp.dense
    page_first = kvmove.StagingBuffer(kv, num_slots=2, page_tokens=4, layout="page_first")
    assert not page_first.row_pool.buffers["kv"].dense  # a token's layers side by side


def test_a_device_constant_on_the_cpu_is_the_values_themselves():
    from kvmove.memory.device_constants import device_constant

    values = torch.arange(5, dtype=torch.int64)
    assert device_constant(values, torch.device("cpu")) is values
