"""PageSender -> PageReceiver across processes (TCP on loopback): every host layout with
hybrid buffers, partial pages, one layer at a time, layer-wise streaming, several threads
and two sender processes into one pool; every byte of the receiver's buffers is checked
(the pages written hold exactly the sender's rows, all other bytes, guard bands around the
pool included, are as they were)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove import Status
from tests.direct.conftest import HYBRID, KV_SLOTS, PAGE_TOKENS, PAGES
from tests.support.direct_pools import LAYOUTS, kv_layers

P = PAGE_TOKENS


def token_pages(first_slot: int, n: int, valid=None) -> torch.Tensor:
    """``n`` pages of consecutive KV slots from ``first_slot``; ``valid[i]`` tokens each
    (the rest -1)."""
    tp = torch.arange(first_slot, first_slot + n * P).reshape(n, P)
    for i, v in enumerate(valid or []):
        tp[i, v:] = -1
    return tp


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_land_exactly_in_every_layout(layout, receivers, sender, kv_bytes):
    rx = receivers[layout]
    # Consecutive and scattered destinations; a partial page inside the run and at its end.
    tp = token_pages(40, 6, valid=[P, P, 1, P, P, 3])
    dst = [3, 4, 5, 6, 12, 0]
    expected = rx.expect(kv_bytes, tp, dst)
    assert sender.send(rx.handle, tp, dst).wait(30) == [Status.OK] * 6
    rx.assert_holds(expected)
    # One layer: layer 3 exists in "kv" only, layer 1 in both buffers.
    for layer in (3, 1):
        tp = token_pages(100 + 8 * layer, 2, valid=[P, 2])
        expected = rx.expect(kv_bytes, tp, [9, 10], layers=layer)
        assert sender.send(rx.handle, tp, [9, 10], layers=layer).wait(30) == [Status.OK] * 2
        rx.assert_holds(expected)


def test_layerwise_streaming_lands_the_same_bytes(receivers, sender, kv_bytes):
    rx = receivers["layer_first"]
    tp = token_pages(8, 5, valid=[P, P, P, P, 2])
    dst = [11, 12, 13, 14, 15]
    expected = rx.expect(kv_bytes, tp, dst)
    # A prefill loop: one send per layer as it is computed, all waited for at the end.
    transfers = [sender.send(rx.handle, tp, dst, layers=layer) for layer in range(4)]
    assert [t.wait(30) for t in transfers] == [[Status.OK] * 5] * 4
    rx.assert_holds(expected)


def test_a_layerwise_stream_takes_its_slots_once(receivers, kv_bytes):
    # 4 pages, 4 staging slots, 4 layers in flight at once: the slots of each layer are
    # separate memory, so no send waits for another (alloc_timeout=0 would raise).
    rx = receivers["page_first_direct"]
    tp = token_pages(60, 4)
    with kvmove.PageSender(kvmove.KVCache(kv_bytes), page_tokens=P, staging_slots=4,
                           alloc_timeout=0, hostname="127.0.0.1") as tx:
        expected = rx.expect(kv_bytes, tp, [1, 2, 7, 8])
        transfers = [tx.send(rx.handle, tp, [1, 2, 7, 8], layers=layer) for layer in range(4)]
        assert all(t.wait(30) == [Status.OK] * 4 for t in transfers)
    rx.assert_holds(expected)


def test_a_send_larger_than_the_staging_goes_in_pieces(receivers, sender, kv_bytes):
    rx = receivers["page_first"]
    tp = token_pages(0, PAGES)  # 16 pages through 8 slots
    dst = list(range(PAGES))[::-1]
    expected = rx.expect(kv_bytes, tp, dst)
    assert sender.send(rx.handle, tp, dst).wait(30) == [Status.OK] * PAGES
    rx.assert_holds(expected)


def test_one_sender_from_several_threads(receivers, sender, kv_bytes):
    rx = receivers["layer_first"]
    jobs = [(token_pages(4 * i, 2, valid=[P, 1 + i % P]), [2 * i, 2 * i + 1], i % 3 or None)
            for i in range(6)]
    wholes = rx.read()
    views = rx.views(wholes)
    from tests.support.direct_pools import apply_send

    for tp, dst, layer in jobs:
        apply_send(views, kv_bytes, "layer_first", P, tp, dst, layer)
    results = [None] * len(jobs)

    def run(i, tp, dst, layer):
        results[i] = sender.send(rx.handle, tp, dst, layers=layer).wait(30)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [[Status.OK] * 2] * len(jobs)
    rx.assert_holds(wholes)


def test_two_sender_processes_into_one_pool_at_once(peers, receivers, sender, kv_bytes):
    rx = receivers["layer_first"]
    other = peers[0].call("sender", buffers=HYBRID, slots=KV_SLOTS, seed=11, page_tokens=P,
                          staging_slots=8)["id"]
    other_kv = kv_layers(HYBRID, KV_SLOTS, seed=11)
    mine, theirs = token_pages(16, 6), token_pages(200, 6, valid=[P, P, P, P, P, 2])
    my_dst, their_dst = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]
    wholes = rx.read()
    from tests.support.direct_pools import apply_send

    apply_send(rx.views(wholes), kv_bytes, "layer_first", P, mine, my_dst)
    apply_send(rx.views(wholes), other_kv, "layer_first", P, theirs, their_dst, None)
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(peers[0].call(
        "send", key=other, handle=rx.handle, token_pages=theirs.tolist(), dst_pages=their_dst,
        layerwise=True)))
    thread.start()
    mine_statuses = [sender.send(rx.handle, mine, my_dst, layers=layer).wait(30)
                     for layer in range(4)]
    thread.join(60)
    peers[0].call("close", key=other)
    assert mine_statuses == [[Status.OK] * 6] * 4
    assert answer["statuses"] == [["ok"] * 6] * 4
    rx.assert_holds(wholes)


@st.composite
def sends(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    n = draw(st.integers(1, 6))
    dst = draw(st.permutations(range(PAGES)))[:n]
    first = draw(st.lists(st.integers(0, KV_SLOTS - 1), min_size=n * P, max_size=n * P))
    valid = [draw(st.integers(1, P)) for _ in range(n)]
    layer = draw(st.none() | st.integers(0, 3))
    tp = torch.tensor(first).reshape(n, P)
    for i, v in enumerate(valid):
        tp[i, v:] = -1
    return layout, tp, dst, layer


@settings(max_examples=12, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sends())
def test_any_page_pattern_lands_exactly(receivers, sender, kv_bytes, case):
    layout, tp, dst, layer = case
    rx = receivers[layout]
    expected = rx.expect(kv_bytes, tp, dst, layer)
    assert sender.send(rx.handle, tp, dst, layers=layer).wait(30) == [Status.OK] * len(dst)
    rx.assert_holds(expected)
