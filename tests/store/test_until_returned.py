"""``MooncakeStore.get`` / ``put`` with ``until_returned=True``, against a real embedded
master: the data calls run on the caller's thread (no hand-off), and a call past
``call_timeout`` is still given up at the bound (logged, its client replaced, its keys
``FAILED`` with ``CALL_TIMEOUT``), but the put or get returns only once Mooncake has, with
no ``late`` left (a replica failover's read given up included). A put's exists check, which
names no memory, stays handed off and answered at its bound. In time, the same statuses and
bytes as without it."""

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
    CHECK,
    GET,
    PUT,
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
    """The store calls handed to the runner thread from now on."""
    runner, calls = default_runner(), []
    submit = runner.submit

    def counting(fn, *args):
        if getattr(fn, "__name__", "") in {"_check_then_put", CHECK, PUT, GET}:
            calls.append(fn.__name__)
        return submit(fn, *args)

    monkeypatch.setattr(runner, "submit", counting)
    return calls


def _given_up_at(caplog, t0: float) -> list[float]:
    """When (seconds after ``t0``) each "gave no answer" warning was logged."""
    return [r.created - t0 for r in caplog.records if "gave no answer" in r.getMessage()]


def test_in_time_the_calls_run_here_with_the_same_statuses_and_bytes(slow, keyspace,
                                                                     handed):
    s, client = slow
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=8, page_tokens=PAGE, seed=51)
    keys = keyspace(3)
    here = threading.get_ident()
    put = s.put(kvmove.describe(staging, range(3), keys), detect_exists=True,
                until_returned=True)
    assert list(put) == [Status.OK] * 3 and put.late is None and put.late_stored is None
    assert client.names() == [CHECK, PUT] and client.threads(PUT) == [here]
    assert client.threads(CHECK) != [here] and handed == [CHECK]  # the check: handed off
    # An existing key: EXISTS, unsent, as without until_returned; a missing one: MISS.
    again = s.put(kvmove.describe(staging, [0, 3], [keys[0], *keyspace(1, "more")]),
                  detect_exists=True, until_returned=True)
    assert list(again) == [Status.EXISTS, Status.OK] and again.codes == [-705, 0]
    got = s.get(kvmove.describe(staging, [4, 5, 6, 7], [*keys, "never-stored"]),
                until_returned=True)
    assert list(got) == [Status.OK] * 3 + [Status.MISS] and got.late is None
    assert client.threads(GET) == [here]
    for dst, src in zip((4, 5, 6), (0, 1, 2), strict=True):
        assert canonical(staging, dst, PAGE) == canonical(staging, src, PAGE)
    assert handed == [CHECK, CHECK]  # only the exists checks went to the runner
    assert calls_in_flight(s) == 0 and not regions_in_use(s)
    with pytest.raises(TypeError, match="until_returned"):
        s.get(kvmove.describe(staging, [4], keys[:1]), until_returned=1)
    with pytest.raises(TypeError, match="until_returned"):
        s.put(kvmove.describe(staging, [4], keys[:1]), until_returned="yes")


def test_a_get_past_the_bound_is_given_up_then_and_returns_when_mooncake_does(
        slow, keyspace, caplog):
    s, client = slow
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=52)
    keys = keyspace(2)
    assert s.put(kvmove.describe(staging, range(2), keys)).all_ok
    client.delay[GET] = 4 * BOUND
    caplog.set_level(logging.WARNING, logger="kvmove.store")
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
    while s.raw_client is client:
        assert time.monotonic() < deadline, "the client was not replaced"
        time.sleep(0.02)


def test_a_put_past_the_bound_reports_what_it_stored(slow, keyspace, caplog):
    s, client = slow
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=53)
    keys = keyspace(2)
    caplog.set_level(logging.WARNING, logger="kvmove.store")
    client.delay[PUT] = 4 * BOUND
    t0 = time.time()
    result = s.put(kvmove.describe(staging, range(2), keys), detect_exists=False,
                   until_returned=True)
    assert time.time() - t0 >= 4 * BOUND  # Mooncake has stopped reading the rows
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CALL_TIMEOUT] * 2
    assert result.late is None and not regions_in_use(s)
    assert sorted(result.late_stored.result(0)) == sorted(keys)  # known already
    given_up = _given_up_at(caplog, t0)
    assert len(given_up) == 1 and BOUND <= given_up[0] < 3 * BOUND
    assert client.threads(PUT) == [threading.get_ident()]


def test_a_check_past_the_bound_answers_then_and_puts_nothing(slow, keyspace):
    # The exists check names no memory: the put answers at the check's bound, as without
    # until_returned, and no put follows, even once the check returned.
    s, client = slow
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=54)
    keys = keyspace(2)
    client.delay[CHECK] = 4 * BOUND
    t0 = time.monotonic()
    result = s.put(kvmove.describe(staging, range(2), keys), detect_exists=True,
                   until_returned=True)
    assert BOUND <= time.monotonic() - t0 < 3 * BOUND
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CALL_TIMEOUT] * 2
    time.sleep(4 * BOUND)  # the check returns meanwhile
    assert client.names() == [CHECK]  # no put followed
    assert s.raw_client is client  # a check moves no data: its client stays
    client.delay.clear()
    assert s.exists(keys) == [False, False]


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
