"""Pinned staging far larger than a page table's worth: over 1 GiB (one registration, no
span crossing where a 1 GiB registration chunk used to end) and over 4 GiB, where row and
byte offsets no longer fit 32 bits — the direct kernel, the two-hop path and the
descriptors all reach slots past 4 GiB."""

from __future__ import annotations

import torch

import kvmove
from tests.gpu.common import CUDA, build, random_pages


def test_staging_over_1_gib_moves_pages_across_the_old_chunk_boundary():
    from tests.support.staging_data import spans_crossing

    rb, pt, slots_n = 656, 64, 13000  # 2 layers of 546 MB: one region of 1.09 GB
    kv = build([("kv", 2, rb, torch.uint8, 0)], 4096)
    staging = kvmove.StagingBuffer(kv, num_slots=slots_n, page_tokens=pt)
    page, layer_bytes = pt * rb, slots_n * pt * rb
    assert staging.nbytes > 1 << 30
    assert staging.registrations == staging.regions()  # one registration for the buffer
    # The slot of layer 1 that holds byte 1 GiB, where a 1 GiB registration chunk ended.
    straddle = ((1 << 30) - layer_bytes) // page
    assert layer_bytes + straddle * page < 1 << 30 < layer_bytes + (straddle + 1) * page
    slots = torch.tensor([straddle, straddle + 1, straddle - 1, slots_n - 1, 0])
    pages = random_pages(4096, len(slots), pt, pad=False)
    desc = kvmove.describe(staging, slots, [f"k{i}" for i in range(len(slots))])
    spans = [(p, n) for ps, ns in zip(desc.ptrs, desc.sizes, strict=True)
             for p, n in zip(ps, ns, strict=True)]
    assert spans_crossing(spans, staging.registrations) == []
    check_every_backend(kv, staging, pages, slots)
    staging.close()


def test_staging_over_4_gib_reaches_slots_past_32_bit_offsets():
    rb, pt, slots_n = 656, 64, 110_000  # one layer of 4.62 GB: byte offsets past 2**32
    kv = build([("kv", 1, rb, torch.uint8, 0)], 4096)
    staging = kvmove.StagingBuffer(kv, num_slots=slots_n, page_tokens=pt)
    page = pt * rb
    assert staging.nbytes > 4 << 30
    first_past = -(-(4 << 30) // page)  # the first slot that starts past 4 GiB
    slots = torch.tensor([slots_n - 1, first_past, first_past - 1, 5, first_past + 777])
    assert int(slots.max()) * page > 1 << 32
    pages = random_pages(4096, len(slots), pt, pad=False, seed=3)
    desc = kvmove.describe(staging, slots, [f"k{i}" for i in range(len(slots))])
    base = staging.tensor("kv").data_ptr()
    assert [ps[0] for ps in desc.ptrs] == [base + int(s) * page for s in slots]
    check_every_backend(kv, staging, pages, slots)
    staging.close()


def check_every_backend(kv, staging, pages, slots):
    """Gather ``pages`` into ``slots`` with each backend (the same bytes as torch's), then
    scatter them into a fresh cache (the rows come back)."""
    reference = None
    layers = kv.num_layers("kv")
    for backend in ("torch", "triton", "two_hop"):
        staging.tensor("kv").index_fill_(1, slots, 0)
        kvmove.gather(kv, staging, pages, slots, backend=backend)
        torch.cuda.synchronize()
        got = staging.tensor("kv")[:, slots].clone()
        if reference is None:
            reference = got
            rows = pages.reshape(-1).to(CUDA)
            for layer in range(layers):
                want = kv.layer("kv", layer)[rows].cpu().view(len(slots), -1)
                assert torch.equal(got[layer], want), "torch gather differs from the KV"
        assert torch.equal(got, reference), f"{backend} gather differs"
        other = build([("kv", layers, kv.row_bytes("kv"), torch.uint8, 0)], 4096, seed=5)
        kvmove.scatter(staging, slots, other, pages, backend=backend)
        torch.cuda.synchronize()
        for layer in range(layers):
            rows = pages.reshape(-1).to(CUDA)
            assert torch.equal(other.layer("kv", layer)[rows], kv.layer("kv", layer)[rows]), \
                f"{backend} scatter differs"
