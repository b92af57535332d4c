"""``MooncakeStore.begin_put``: a put whose exists check runs while the caller makes its
descriptors, against a real embedded master. It must give what ``put`` gives (statuses,
codes, bytes), for any subset of its keys, and let its client go however it ends; the put's
retry of keys whose transfer failed is checked here too."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import kvmove
from kvmove import Status
from kvmove.status import LEASE_EXPIRED, TRANSFER_FAIL
from tests.support.staging_data import GEOMETRIES, canonical, make_staging
from tests.support.store_state import calls_in_flight, swap_client

pytestmark = pytest.mark.store

PAGE = 4


def _zero(staging, slots):
    for name in staging.buffer_names:
        staging.tensor(name)[:, slots] = 0


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_begin_put_gives_what_put_gives_for_a_subset_in_any_order(store, keyspace, geometry):
    staging = make_staging(GEOMETRIES[geometry], num_slots=12, page_tokens=PAGE, seed=3)
    keys = keyspace(5)
    stored = canonical(staging, 0, PAGE)
    assert store.put(kvmove.describe(staging, [0], keys[:1])).all_ok  # keys[0] exists
    staging.tensor(staging.buffer_names[0])[:, 0] ^= 0x5A  # what a second put would send
    want = {k: canonical(staging, s, PAGE) for k, s in zip(keys[1:], [1, 2, 3, 4],
                                                            strict=True)}
    want[keys[0]] = stored
    with store.begin_put(keys) as pending:
        # keys[2] left out; the others in another order than begun
        desc = kvmove.describe(staging, [3, 0, 4, 1], [keys[3], keys[0], keys[4], keys[1]])
        result = pending.put(desc)
    assert list(result) == [Status.OK, Status.EXISTS, Status.OK, Status.OK]
    assert result.codes == [0, -705, 0, 0]
    assert store.exists(keys) == [True, True, False, True, True]
    _zero(staging, range(6, 10))
    order = [keys[0], keys[1], keys[3], keys[4]]
    assert store.get(kvmove.describe(staging, range(6, 10), order)).all_ok
    for slot, key in zip(range(6, 10), order, strict=True):
        assert canonical(staging, slot, PAGE) == want[key], key
    assert calls_in_flight(store) == 0


def test_begin_put_refuses_a_key_it_was_not_begun_with_before_sending(store, keyspace):
    staging = make_staging(GEOMETRIES["mla"], num_slots=2, page_tokens=PAGE, seed=4)
    keys = keyspace(2)
    with store.begin_put(keys[:1]) as pending, pytest.raises(ValueError, match=repr(keys[1])):
        pending.put(kvmove.describe(staging, [0, 1], keys))
    with store.begin_put(keys[:1], detect_exists=False) as pending, \
            pytest.raises(ValueError, match=repr(keys[1])):  # with no check begun too
        pending.put(kvmove.describe(staging, [0, 1], keys))
    assert store.exists(keys) == [False, False]
    with pytest.raises(kvmove.StoreError, match="ended"):
        pending.put(kvmove.describe(staging, [0], keys[:1]))
    with pytest.raises(ValueError, match="empty string"):
        store.begin_put(["a", ""])
    assert calls_in_flight(store) == 0


def test_a_begun_put_never_made_lets_its_client_go(keyspace):
    s = kvmove.MooncakeStore.embedded(global_segment_size="16mb")
    try:
        pending = s.begin_put(keyspace(3))
        assert calls_in_flight(s) == 1
        pending.close()
        pending.close()  # idempotent
        assert calls_in_flight(s) == 0
        t0 = time.monotonic()
    finally:
        s.close()  # waits for calls in flight: none
    assert time.monotonic() - t0 < 10
    with pytest.raises(kvmove.StoreError, match="closed"):
        s.begin_put(["k"])


def test_more_keys_than_one_call_check_per_call(keyspace):
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb", max_batch_keys=2) as s:
        staging = make_staging(GEOMETRIES["mla"], num_slots=5, page_tokens=PAGE, seed=5)
        keys = keyspace(5)
        assert s.put(kvmove.describe(staging, [1, 4], [keys[1], keys[4]])).all_ok
        with s.begin_put(keys) as pending:
            result = pending.put(kvmove.describe(staging, range(5), keys))
        assert list(result) == [Status.OK, Status.EXISTS, Status.OK, Status.OK, Status.EXISTS]
        assert s.exists(keys) == [True] * 5


def test_a_check_the_master_did_not_answer_fails_every_key_untried(keyspace):
    s = kvmove.MooncakeStore.embedded(global_segment_size="16mb")
    try:
        staging = make_staging(GEOMETRIES["mla"], num_slots=3, page_tokens=PAGE, seed=6)
        keys = keyspace(3)
        client = swap_client(s, lambda real: _FailingFirstPut(real, set(), 0, set()))
        os.kill(s.master.pid, signal.SIGKILL)
        while s.master.running:
            time.sleep(0.01)
        with s.begin_put(keys) as pending:
            result = pending.put(kvmove.describe(staging, range(3), keys))
        assert list(result) == [Status.FAILED] * 3 and result.codes == [-900] * 3
        assert client.put_calls == []  # the check's RPC error ended the put
    finally:
        s.close()


class _FailingFirstPut:
    """A Mooncake client that forwards every call, except that its first put answers
    ``code`` for the keys in ``fail`` without sending them (as a put whose transfer failed,
    or whose lease expired, answers: nothing stored); puts after it fail ``fail_again``."""

    def __init__(self, real, fail: set[str], code: int, fail_again: set[str]):
        self._real = real
        self.fail, self.code, self.fail_again = fail, code, fail_again
        self.put_calls: list[list[str]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config):
        with self._lock:
            first = not self.put_calls
            self.put_calls.append(list(keys))
        failing = self.fail if first else self.fail_again
        sent = [i for i, k in enumerate(keys) if k not in failing]
        codes = [self.code] * len(keys)
        if sent:
            got = self._real.batch_put_from_multi_buffers(
                [keys[i] for i in sent], [ptrs[i] for i in sent], [sizes[i] for i in sent],
                config)
            for i, c in zip(sent, got, strict=True):
                codes[i] = c
        return codes


@pytest.mark.parametrize("code", [TRANSFER_FAIL, LEASE_EXPIRED])
@pytest.mark.parametrize("begun", [False, True])
def test_a_put_tries_once_more_only_the_keys_whose_transfer_failed(keyspace, code, begun):
    with kvmove.MooncakeStore.embedded(global_segment_size="16mb") as s:
        staging = make_staging(GEOMETRIES["mha"], num_slots=10, page_tokens=PAGE, seed=9)
        keys = keyspace(5)
        assert s.put(kvmove.describe(staging, [0], keys[:1])).all_ok  # EXISTS below
        client = swap_client(s, lambda real: _FailingFirstPut(
            real, {keys[1], keys[3]}, code, fail_again={keys[3]}))
        desc = kvmove.describe(staging, range(5), keys)
        if begun:
            with s.begin_put(keys) as pending:
                result = pending.put(desc)
        else:
            result = s.put(desc)
        assert client.put_calls == [keys[1:], [keys[1], keys[3]]]
        assert list(result) == [Status.EXISTS, Status.OK, Status.OK, Status.FAILED, Status.OK]
        assert result.codes == [-705, 0, 0, code, 0]
        assert s.exists(keys) == [True, True, True, False, True]
        _zero(staging, range(5, 8))
        assert s.get(kvmove.describe(staging, range(5, 8), [keys[1], keys[2], keys[4]])).all_ok
        for dst, src in zip(range(5, 8), [1, 2, 4], strict=True):
            assert canonical(staging, dst, PAGE) == canonical(staging, src, PAGE)
