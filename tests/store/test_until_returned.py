"""``MooncakeStore.get(..., until_returned=True)``, against a real embedded master: the
reads run on the caller's thread (no hand-off), and a read past ``call_timeout`` is still
given up at the bound (logged, its client replaced, its keys ``FAILED`` with
``CALL_TIMEOUT``), but the get returns only once Mooncake has, with no ``late`` left (a
replica failover's read given up included). In time, the same statuses and bytes as
without it."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

import kvmove
from kvmove import Status
from kvmove.status import CALL_TIMEOUT, TRANSFER_FAIL
from kvmove.store.bounded_call import default_runner
from tests.support.staging_data import GEOMETRIES, canonical, make_staging
from tests.support.store_state import (
    GET,
    SlowClient,
    calls_in_flight,
    regions_in_use,
    swap_client,
)

pytestmark = pytest.mark.store

PAGE = 4
BOUND = 0.5


@pytest.fixture
def slow():
    """A store of its own (a call given up replaces its client), calls given up at
    ``BOUND``, its client a :class:`SlowClient`."""
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", call_timeout=BOUND) as s:
        yield s, swap_client(s, SlowClient)


@pytest.fixture
def handed(monkeypatch) -> list:
    """The gets handed to the runner thread from now on."""
    runner, calls = default_runner(), []
    submit = runner.submit

    def counting(fn, *args):
        if getattr(fn, "__name__", "") == GET:
            calls.append(fn.__name__)
        return submit(fn, *args)

    monkeypatch.setattr(runner, "submit", counting)
    return calls


def _given_up_at(caplog, t0: float) -> list[float]:
    """When (seconds after ``t0``) each "gave no answer" warning was logged."""
    return [r.created - t0 for r in caplog.records if "gave no answer" in r.getMessage()]


def test_in_time_the_reads_run_here_with_the_same_statuses_and_bytes(slow, keyspace, handed):
    s, client = slow
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=8, page_tokens=PAGE, seed=51)
    keys = keyspace(3)
    assert s.put(kvmove.describe(staging, range(3), keys)).all_ok
    handed.clear()
    here = threading.get_ident()
    got = s.get(kvmove.describe(staging, [4, 5, 6, 7], [*keys, "never-stored"]),
                until_returned=True)
    assert list(got) == [Status.OK] * 3 + [Status.MISS] and got.late is None
    assert client.threads(GET) == [here]
    for dst, src in zip((4, 5, 6), (0, 1, 2), strict=True):
        assert canonical(staging, dst, PAGE) == canonical(staging, src, PAGE)
    assert handed == []  # nothing went to the runner
    # Without it, the same read goes to the runner, with the same statuses.
    plain = s.get(kvmove.describe(staging, [4, 5, 6, 7], [*keys, "never-stored"]))
    assert list(plain) == list(got) and plain.codes == got.codes and handed == [GET]
    assert calls_in_flight(s) == 0 and not regions_in_use(s)
    with pytest.raises(TypeError, match="until_returned"):
        s.get(kvmove.describe(staging, [4], keys[:1]), until_returned=1)


def test_a_get_past_the_bound_is_given_up_then_and_returns_when_mooncake_does(
        slow, keyspace, caplog):
    s, client = slow
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=52)
    keys = keyspace(2)
    assert s.put(kvmove.describe(staging, range(2), keys)).all_ok
    client.delay[GET] = 4 * BOUND
    caplog.set_level(logging.WARNING, logger="kvmove.store.mooncake_store")
    t0 = time.time()
    result = s.get(kvmove.describe(staging, [2, 3], keys), until_returned=True)
    took = time.time() - t0
    assert took >= 4 * BOUND  # returned once Mooncake had: the rows are free now
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CALL_TIMEOUT] * 2
    assert result.late is None and not regions_in_use(s)
    given_up = _given_up_at(caplog, t0)
    assert len(given_up) == 1 and BOUND <= given_up[0] < 3 * BOUND  # at the bound
    assert client.threads(GET) == [threading.get_ident()]
    # A data call given up: the client is replaced. (What the store holds afterwards is
    # not asked: the retired wrapper's segment goes with it, see test_check_then_put.py.)
    deadline = time.monotonic() + 10
    while s._client is client:
        assert time.monotonic() < deadline, "the client was not replaced"
        time.sleep(0.02)


def test_a_failover_read_given_up_is_waited_for_too(slow, keyspace, monkeypatch):
    # A key whose get failed in transport is read from another replica (its own call,
    # handed off and bounded); a read given up there still writes into the spans until it
    # returns, so until_returned waits for it as well, and .late is None.
    s, client = slow
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=55)
    keys = keyspace(2)
    assert s.put(kvmove.describe(staging, range(2), keys)).all_ok
    monkeypatch.setattr(client, "batch_get_into_multi_buffers",
                        lambda k, ptrs, sizes: [TRANSFER_FAIL] * len(k))
    reads: list[Future] = []

    def failover(_client, _desc, _codes):  # a read given up, returning 4 x BOUND later
        read = Future()
        threading.Timer(4 * BOUND, read.set_result, (None,)).start()
        reads.append(read)
        return read

    monkeypatch.setattr(s, "_failover", failover)
    t0 = time.monotonic()
    result = s.get(kvmove.describe(staging, [2, 3], keys), until_returned=True)
    assert time.monotonic() - t0 >= 4 * BOUND and reads[0].done()
    assert result.late is None and not regions_in_use(s)
    assert Status.OK not in result
    t0 = time.monotonic()
    handed_back = s.get(kvmove.describe(staging, [2, 3], keys))  # without: back at once
    assert time.monotonic() - t0 < 2 * BOUND
    assert handed_back.late is not None and not handed_back.late.done()
    handed_back.late.result(10)
