"""Every bad input API.md names raises the named exception before anything is written."""

from __future__ import annotations

import pytest
import torch

import kvmove
from tests.support.caches import assert_same, make_layers, snapshot


def world():
    kv = kvmove.KVCache({"kv": make_layers(2, 16, 132, torch.uint8, seed=1),
                         "ix": make_layers(1, 16, 4, torch.float32, seed=2)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=2)
    staging.tensor("kv").fill_(5)
    staging.tensor("ix").fill_(6)
    return kv, staging


TP = torch.tensor([[0, 1], [2, 3]])
SL = torch.tensor([0, 1])

GATHER_CASES = [
    ("float token_pages", dict(token_pages=TP.float()), TypeError, "token_pages"),
    ("int16 token_pages", dict(token_pages=TP.to(torch.int16)), TypeError, "int32 or int64"),
    ("1-D token_pages", dict(token_pages=TP.reshape(-1)), ValueError, "dimension"),
    ("wrong page_tokens", dict(token_pages=torch.zeros(2, 3, dtype=torch.int64)), ValueError,
     "page_tokens"),
    ("pages of no tokens", dict(token_pages=torch.zeros(2, 0, dtype=torch.int64)), ValueError,
     "page_tokens"),
    ("length mismatch", dict(slots=torch.tensor([0])), ValueError, "slots"),
    ("token out of range", dict(token_pages=torch.tensor([[0, 16], [1, 2]])), IndexError,
     "token_pages"),
    ("token below -1", dict(token_pages=torch.tensor([[0, -2], [1, 2]])), IndexError, "-2"),
    ("slot out of range", dict(slots=torch.tensor([0, 4])), IndexError, "slots"),
    ("negative slot", dict(slots=torch.tensor([0, -3])), IndexError, "slots"),
    ("duplicate slots", dict(slots=torch.tensor([1, 1])), ValueError, "more than once"),
    ("float slots", dict(slots=torch.tensor([0.0, 1.0])), TypeError, "slots"),
    ("bad backend", dict(backend="cuda"), ValueError, "backend"),
    ("list of floats", dict(slots=[0.5, 1]), TypeError, "slots"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("case", "override", "error", "match"), GATHER_CASES,
                         ids=[c[0] for c in GATHER_CASES])
def test_gather_rejects(case, override, error, match, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv, staging = world()
    before_kv, before_st = snapshot(kv), snapshot(staging)
    args = dict(token_pages=TP, slots=SL, backend=backend) | override
    with pytest.raises(error, match=match):
        kvmove.gather(kv, staging, args.pop("token_pages"), args.pop("slots"), **args)
    assert_same(before_st, snapshot(staging))
    assert_same(before_kv, snapshot(kv))


SCATTER_CASES = [
    ("duplicate destination rows", dict(token_pages=torch.tensor([[0, 1], [1, 3]])), ValueError,
     "more than once"),
    ("duplicate whole pages", dict(token_pages=torch.tensor([[2, 3], [2, 3]])), ValueError,
     "more than once"),
    ("token out of range", dict(token_pages=torch.tensor([[0, 99], [1, 2]])), IndexError,
     "token_pages"),
    ("layer out of range", dict(layers=2), IndexError, "layer 2"),
    ("layer not an int", dict(layers="0"), TypeError, "layers"),
    ("bool layer", dict(layers=True), TypeError, "layers"),
    ("duplicate layers", dict(layers=[0, 0]), ValueError, "twice"),
    ("slot out of range", dict(slots=torch.tensor([4, 0])), IndexError, "slots"),
    ("pages of no tokens", dict(token_pages=torch.zeros(2, 0, dtype=torch.int64)), ValueError,
     "page_tokens"),
]


@pytest.mark.parametrize(("case", "override", "error", "match"), SCATTER_CASES,
                         ids=[c[0] for c in SCATTER_CASES])
def test_scatter_rejects(case, override, error, match):
    kv, staging = world()
    before = snapshot(kv)
    args = dict(token_pages=TP, slots=SL) | override
    with pytest.raises(error, match=match):
        kvmove.scatter(staging, args.pop("slots"), kv, args.pop("token_pages"), **args)
    assert_same(before, snapshot(kv))


def test_caches_of_different_geometry_are_rejected():
    kv, staging = world()
    other = kvmove.KVCache({"kv": make_layers(3, 16, 132, torch.uint8),
                            "ix": make_layers(1, 16, 4, torch.float32)})
    with pytest.raises(ValueError, match="geometry"):
        kvmove.gather(other, staging, TP, SL)
    renamed = kvmove.KVCache({"k": make_layers(2, 16, 132, torch.uint8),
                              "ix": make_layers(1, 16, 4, torch.float32)})
    with pytest.raises(ValueError, match="geometry"):
        kvmove.copy_rows(renamed, torch.tensor([0]), kv, torch.tensor([0]))
    with pytest.raises(TypeError, match="kv"):
        kvmove.gather(staging, staging, TP, SL)
    with pytest.raises(TypeError, match="src"):
        kvmove.copy_rows("kv", torch.tensor([0]), kv, torch.tensor([0]))


def test_copy_rows_rejects_mismatched_lengths_and_duplicates():
    kv, staging = world()
    with pytest.raises(ValueError, match="dst_rows"):
        kvmove.copy_rows(kv, torch.tensor([0, 1]), staging, torch.tensor([0]))
    with pytest.raises(ValueError, match="more than once"):
        kvmove.copy_rows(kv, torch.tensor([0, 1]), staging, torch.tensor([3, 3]))
    with pytest.raises(IndexError, match="dst_rows"):
        kvmove.copy_rows(kv, torch.tensor([0]), staging, torch.tensor([8]))


def test_copy_within_one_pool_must_not_write_a_row_it_reads():
    kv, _ = world()
    before = snapshot(kv)
    with pytest.raises(ValueError, match="row 1 of the same pool"):
        kvmove.copy_rows(kv, torch.tensor([1, 3, -1]), kv, torch.tensor([3, 5, 1]))
    assert_same(before, snapshot(kv))


def test_empty_batches_are_a_no_op():
    kv, staging = world()
    before = snapshot(staging)
    kvmove.gather(kv, staging, torch.zeros(0, 2, dtype=torch.int64),
                  torch.zeros(0, dtype=torch.int64))
    kvmove.copy_rows(kv, [], staging, [])
    assert_same(before, snapshot(staging))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_scatter_of_many_whole_pages_refuses_one_named_twice(backend):
    """Past the few-pages plan (more than 64 rows: the numpy plan of a paged KV cache, which
    sees no -1 and so counts none in the duplicate check), a KV page named twice still
    raises before any row is written."""
    kv = kvmove.KVCache({"kv": make_layers(2, 128, 132, torch.uint8, seed=3)})
    staging = kvmove.StagingBuffer(kv, num_slots=40, page_tokens=2)
    staging.tensor("kv").fill_(7)
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(4))[:40]
    pages[-1] = pages[0]
    token_pages = pages[:, None] * 2 + torch.arange(2)
    before = snapshot(kv)
    with pytest.raises(ValueError, match=f"names row/slot {int(pages[0]) * 2} more than once"):
        kvmove.scatter(staging, torch.arange(40), kv, token_pages, backend=backend)
    assert_same(before, snapshot(kv))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_scatter_of_many_pages_refuses_a_row_named_twice_in_a_scattered_page(backend):
    """Whole pages and one scattered page, every row in range (a plan that saw no -1): a
    scattered page naming a row another page writes still raises before any row is
    written."""
    kv = kvmove.KVCache({"kv": make_layers(2, 128, 132, torch.uint8, seed=5)})
    staging = kvmove.StagingBuffer(kv, num_slots=40, page_tokens=2)
    staging.tensor("kv").fill_(7)
    pages = torch.randperm(64, generator=torch.Generator().manual_seed(6))[:40]
    token_pages = pages[:, None] * 2 + torch.arange(2)
    token_pages[-1] = torch.tensor([int(token_pages[3, 1]), int(token_pages[-1, 0])])
    before = snapshot(kv)
    with pytest.raises(ValueError, match=f"names row/slot {int(token_pages[3, 1])} more than"):
        kvmove.scatter(staging, torch.arange(40), kv, token_pages, backend=backend)
    assert_same(before, snapshot(kv))
