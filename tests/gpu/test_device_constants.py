"""On a CUDA GPU (skipped elsewhere): a device constant is made while the caller's stream is
busy without waiting for it, is complete when made (another stream reads it at once, with
no ordering), and holds the values."""

from __future__ import annotations

import torch

from kvmove.memory.device_constants import device_constant
from tests.gpu.common import CUDA, BusyDevice


def test_a_constant_is_made_while_the_stream_is_busy_and_read_from_another():
    values = torch.arange(4096, dtype=torch.int64) * 7 - 3
    busy = BusyDevice()
    table = device_constant(values, CUDA)
    assert busy.still_busy(), "device_constant waited for the caller's stream"
    other = torch.cuda.Stream()  # not ordered after the busy stream
    with torch.cuda.stream(other):
        copy = table.clone()
    other.synchronize()
    assert busy.still_busy(), "the read on another stream waited for the busy one"
    assert torch.equal(copy.cpu(), values)
    assert table.device.type == "cuda" and table.dtype == torch.int64
    # Kept, one per value: a cache wrapped again finds its tables (nothing freed under a
    # kernel that may still read them).
    assert device_constant(values.clone(), CUDA) is table
    assert device_constant(values + 1, CUDA) is not table


def test_a_constant_is_refused_under_graph_capture():
    import pytest

    x = torch.ones(4, device=CUDA)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2  # the capture holds work of its own and ends normally
        with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
            device_constant(torch.arange(3, dtype=torch.int64) + 10**6, CUDA)
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [2.0] * 4
