"""On a CUDA GPU (skipped elsewhere): a PageSender whose KV cache lives on the GPU (per-layer
tensors of a hybrid cache, the compiled Triton gather into pinned staging on the sender's
stream, ordered after the caller's stream) writes into a PageReceiver's host pool: every
layout, whole and one layer, partial pages, device-resident token indices written by a
kernel on the caller's stream just before the send. Receiver and sender share this process
(two Transfer Engines in one process work)."""

from __future__ import annotations

import pytest
import torch

import kvmove
from tests.support.direct_pools import LAYOUTS, apply_send, make_pool

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.transfer_engine]

P = 16
BUFFERS = {"kv": [6, 656], "idx": [3, 132]}


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gpu_cache_sends_into_a_host_pool(layout):
    g = torch.Generator().manual_seed(0)
    host_kv = {n: torch.randint(0, 256, (layers, 64 * P, row), dtype=torch.uint8, generator=g)
               for n, (layers, row) in BUFFERS.items()}
    kv = kvmove.KVCache({n: [t[i].cuda() for i in range(t.shape[0])]
                         for n, t in host_kv.items()})
    pool, wholes, views = make_pool({"layout": layout, "page_tokens": P, "pages": 12,
                                     "buffers": BUFFERS}, seed=1)
    expected = {n: w.clone() for n, w in wholes.items()}
    exp_views = {n: expected[n][4096:4096 + v.numel()].view(v.shape) for n, v in views.items()}
    with kvmove.PageReceiver(pool, hostname="127.0.0.1") as rx, \
            kvmove.PageSender(kv, page_tokens=P, staging_slots=8, backend="triton",
                              hostname="127.0.0.1") as tx:
        tp = torch.arange(5 * P).reshape(5, P) + 3 * P
        tp[4, 7:] = -1
        dst = [2, 3, 4, 9, 0]
        apply_send(exp_views, host_kv, layout, P, tp, dst)
        # Device indices written by a kernel on the caller's stream just before the send.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            device_tp = tp.cuda(non_blocking=True)
            t = tx.send(rx.handle, device_tp, dst)
        assert t.wait(60) == [kvmove.Status.OK] * 5
        tp2 = torch.arange(2 * P).reshape(2, P)
        apply_send(exp_views, host_kv, layout, P, tp2, [6, 7], layers=4)
        assert tx.send(rx.handle, tp2, [6, 7], layers=4).wait(60) == [kvmove.Status.OK] * 2
    for name in BUFFERS:
        assert torch.equal(wholes[name], expected[name]), name
