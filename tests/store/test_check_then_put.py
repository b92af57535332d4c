"""A put's exists check and its put made in one call on a runner thread (one thread hand-off,
not two), against a real embedded master: each half keeps the bound it had as a call of its
own. A check given up starts no put, even when it returns later; a put is bounded from its
own start, not from the check's; a put given up is late, and what it stored is reported."""

from __future__ import annotations

import threading
import time

import pytest

import kvmove
from kvmove import Status
from kvmove.status import CALL_TIMEOUT, CLIENT_EXCEPTION
from kvmove.store.bounded_call import default_runner
from tests.support.staging_data import GEOMETRIES, canonical, make_staging
from tests.support.store_state import CHECK, PUT, SlowClient, calls_in_flight, swap_client

pytestmark = pytest.mark.store

PAGE = 4


@pytest.fixture(scope="module")
def bounded_store():
    """A store whose calls are given up at 1 s."""
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", call_timeout=1.0) as s:
        yield s


@pytest.fixture
def slow_store(bounded_store):
    """``bounded_store`` with a :class:`SlowClient` client for one test (the real one after)."""
    real = bounded_store.raw_client
    yield bounded_store, swap_client(bounded_store, SlowClient)
    swap_client(bounded_store, lambda _wrapper: real)


@pytest.fixture
def replaced_store():
    """A store of its own (its client is replaced), calls given up at 1 s, its client a
    :class:`SlowClient`."""
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", call_timeout=1.0) as s:
        yield s, swap_client(s, SlowClient)


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def handed(monkeypatch) -> list:
    """The store calls handed to the runner thread from now on (not another test's
    background work)."""
    runner, calls = default_runner(), []
    submit = runner.submit
    store_calls = {"_check_and_put", CHECK, PUT}

    def counting(fn, *args):
        if getattr(fn, "__name__", "") in store_calls:
            calls.append(fn)
        return submit(fn, *args)

    monkeypatch.setattr(runner, "submit", counting)
    return calls


def test_the_check_and_the_put_are_one_hand_off(slow_store, keyspace, handed):
    s, client = slow_store
    staging = make_staging(GEOMETRIES["hybrid"], num_slots=6, page_tokens=PAGE, seed=41)
    keys = keyspace(3)
    assert list(s.put(kvmove.describe(staging, range(3), keys))) == [Status.OK] * 3
    assert len(handed) == 1  # one call handed to the runner
    (check, on), (put, again) = client.calls
    assert (check, put) == (CHECK, PUT)
    assert on == again != threading.get_ident()  # its thread made both
    # A key that exists: the check's call ends there, the others are put by a call of
    # their own, and nothing stored is overwritten.
    stored = canonical(staging, 0, PAGE)
    staging.tensor(staging.buffer_names[0])[:, 0] ^= 0x5A
    more = [keys[0], *keyspace(1, "more")]
    client.calls.clear()
    handed.clear()
    result = s.put(kvmove.describe(staging, [0, 3], more))
    assert list(result) == [Status.EXISTS, Status.OK] and result.codes == [-705, 0]
    assert client.names() == [CHECK, PUT] and len(handed) == 2
    assert s.get(kvmove.describe(staging, [4, 5], more)).all_ok
    assert canonical(staging, 4, PAGE) == stored
    assert canonical(staging, 5, PAGE) == canonical(staging, 3, PAGE)
    assert calls_in_flight(s) == 0


def test_a_check_given_up_starts_no_put_even_when_it_returns(slow_store, keyspace):
    s, client = slow_store
    staging = make_staging(GEOMETRIES["mla"], num_slots=2, page_tokens=PAGE, seed=42)
    keys = keyspace(2)
    client.delay[CHECK] = 2.0
    t0 = time.monotonic()
    result = s.put(kvmove.describe(staging, range(2), keys))
    took = time.monotonic() - t0
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CALL_TIMEOUT] * 2
    assert 0.9 < took < 1.8, took
    assert result.late is None  # no data call was given up: the rows are free
    assert s._clients.budgets[id(client)].in_flight == 0  # a check holds no spans of the put
    _wait(lambda: CHECK in client.returned)
    time.sleep(0.2)  # where a put would have started after the late check
    assert client.names() == [CHECK]
    client.delay.clear()
    assert s.exists(keys) == [False, False]
    assert s.raw_client is client  # a check given up does not replace the client


def test_a_put_is_bounded_from_its_own_start(slow_store, keyspace):
    # 0.6 s of check and 0.6 s of put: longer than one bound together, within it each.
    s, client = slow_store
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=43)
    keys = keyspace(2)
    client.delay.update({CHECK: 0.6, PUT: 0.6})
    t0 = time.monotonic()
    result = s.put(kvmove.describe(staging, range(2), keys))
    assert list(result) == [Status.OK] * 2, result.codes
    assert time.monotonic() - t0 > 1.2
    client.delay.clear()
    assert s.get(kvmove.describe(staging, [2, 3], keys)).all_ok
    assert canonical(staging, 2, PAGE) == canonical(staging, 0, PAGE)


def test_a_put_given_up_is_late_and_reports_what_it_stored(replaced_store, keyspace):
    s, client = replaced_store
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=44)
    keys = keyspace(2)
    client.delay[PUT] = 2.0
    t0 = time.monotonic()
    result = s.put(kvmove.describe(staging, range(2), keys))
    assert time.monotonic() - t0 < 1.8
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CALL_TIMEOUT] * 2
    assert result.late is not None and not result.late.done()  # Mooncake reads the rows
    assert sorted(result.late_stored.result(10)) == sorted(keys)
    assert result.late.done()
    # A data call given up: the client is replaced. (Whether the keys are still there is
    # not asked: the retired wrapper does not look like the segment's client to the store,
    # which closes it, and the segment with it.)
    _wait(lambda: s.raw_client is not client)


def test_a_put_without_room_for_its_spans_waits_for_it(slow_store, keyspace, handed):
    s, client = slow_store
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=45)
    keys = keyspace(2)
    budget = s._clients.budgets[id(s.raw_client)]
    taken = budget.acquire(budget.limit, 1.0)  # another call's spans fill the queue
    out: list = []
    putter = threading.Thread(
        target=lambda: out.append(s.put(kvmove.describe(staging, range(2), keys))))
    putter.start()
    time.sleep(0.5)
    assert not out and client.names() == [CHECK]  # checked, and waiting for room
    budget.release(taken)
    putter.join(10)
    assert list(out[0]) == [Status.OK] * 2
    # The check's call did not wait for room (holding the runner, outside the check's
    # bound): the put was a call of its own.
    assert [fn.__name__ for fn in handed] == ["_check_and_put", PUT]
    assert s.get(kvmove.describe(staging, [2, 3], keys)).all_ok
    assert canonical(staging, 3, PAGE) == canonical(staging, 1, PAGE)


def test_a_check_that_raises_still_puts_and_a_put_that_raises_fails(slow_store, keyspace):
    # As with two calls: a check that raised answers no key, so every key is put (by a
    # call of its own); a put that raised fails every key, nothing stored.
    s, client = slow_store
    staging = make_staging(GEOMETRIES["mla"], num_slots=4, page_tokens=PAGE, seed=46)
    keys = keyspace(4)
    budget = s._clients.budgets[id(client)]
    client.fail.add(CHECK)
    result = s.put(kvmove.describe(staging, range(2), keys[:2]))
    assert list(result) == [Status.OK] * 2 and client.names() == [CHECK, PUT]
    client.fail, client.calls[:] = {PUT}, []
    result = s.put(kvmove.describe(staging, [2, 3], keys[2:]))
    assert list(result) == [Status.FAILED] * 2 and result.codes == [CLIENT_EXCEPTION] * 2
    assert client.names() == [CHECK, PUT] and result.late is None
    assert budget.in_flight == 0
    client.fail.clear()
    assert s.exists(keys) == [True, True, False, False]
