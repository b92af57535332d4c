"""Several engine processes on one real master (each a ``kvmove.cli.cluster_node`` process with
its own KV cache, store client and mover; nothing mocked):

- two and four processes: what one evicts, the others prefetch byte-exact; unknown keys read
  ``MISS`` with the rows untouched;
- SIGKILL of a process whose segment holds objects: a reader in another process gets ``OK``
  with exact bytes, ``FAILED`` or ``MISS``, never wrong bytes, its other rows untouched;
  within the master's client TTL (plus a heartbeat) the lost objects read ``MISS``;
- with ``replicas=2``: after the same SIGKILL, every page reads back exact from its
  surviving replica once the master has dropped the dead process; the time it took is
  printed (``-s``) and recorded as a test property;
- two stores in one process (one master, or two embedded ones) both work.

Every process is bounded by timeouts and exits on its own (``NodeProcess.close``).
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvmove
from kvmove.cli.cluster_node import ClusterNode, NodeProcess
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S

pytestmark = pytest.mark.store

PAGES = list(range(48))
UNKNOWN = list(range(1000, 1016))
# The master drops a silent client after its TTL; heartbeats come about every second.
RECOVERY_BOUND_S = DEFAULT_CLIENT_TTL_S + 10


@pytest.fixture
def master():
    with kvmove.EmbeddedMaster() as m:
        yield m


@pytest.fixture
def nodes(master, tmp_path):
    """``nodes(n, **options)``: ``n`` engine processes on ``master``, closed at the end."""
    started: list[NodeProcess] = []

    def start(n: int, **options) -> list[NodeProcess]:
        new = [NodeProcess(master.address, log_path=tmp_path / f"node{len(started) + i}.log",
                           **options) for i in range(n)]
        started.extend(new)
        return new

    yield start
    with ThreadPoolExecutor(max(1, len(started))) as pool:
        codes = list(pool.map(NodeProcess.close, started))
    killed = [n.proc.returncode for n in started if n.proc.returncode and n.proc.returncode < 0]
    assert [c for c in codes if c and c > 0] == [], codes  # a clean exit, or our SIGKILL
    assert len(killed) <= 1


def assert_clean(answer: dict) -> None:
    assert answer["wrong"] == [], f"pages read with wrong bytes: {answer['wrong']}"
    assert answer["touched"] == [], f"rows written for pages not read: {answer['touched']}"


@pytest.mark.parametrize("count", [2, 4])
def test_what_one_process_evicts_the_others_prefetch(nodes, count):
    procs = nodes(count)
    assert procs[0].call("evict", pages=PAGES)["statuses"] == ["ok"] * len(PAGES)
    later = [p + 100 for p in PAGES[:16]]  # evicted by another process than the first
    assert procs[-1].call("evict", pages=later)["statuses"] == ["ok"] * len(later)
    for reader in procs[1:]:
        got = reader.call("prefetch", pages=PAGES)
        assert got["statuses"] == ["ok"] * len(PAGES)
        assert got["bytes"] == len(PAGES) * 4 * 16 * (656 + 132)
        assert_clean(got)
        unknown = reader.call("prefetch", pages=UNKNOWN)
        assert unknown["statuses"] == ["miss"] * len(UNKNOWN)
        assert_clean(unknown)
    got = procs[0].call("prefetch", pages=later)
    assert got["statuses"] == ["ok"] * len(later)
    assert_clean(got)


def read_until(reader: NodeProcess, done, bound_s: float, t0: float):
    """Prefetch ``PAGES`` every half second until ``done(statuses)``; the seconds since
    ``t0`` (the kill) and every answer (each checked clean)."""
    answers = []
    while True:
        answer = reader.call("prefetch", pages=PAGES)
        assert_clean(answer)
        answers.append(answer)
        if done(answer["statuses"]):
            return time.monotonic() - t0, answers
        assert time.monotonic() - t0 < bound_s, Counter(answer["statuses"])
        time.sleep(0.5)


def kill_holder(nodes, replicas: int):
    """Two processes that give the store memory (the first evicts every page), a reader
    that gives none (so every object lives on one of the first two); the first is then
    SIGKILLed. Returns the reader and the time of the kill."""
    holder, _other = nodes(2, replicas=replicas)
    reader, = nodes(1, replicas=replicas, segment="0")
    assert holder.call("evict", pages=PAGES)["statuses"] == ["ok"] * len(PAGES)
    assert reader.call("prefetch", pages=PAGES)["statuses"] == ["ok"] * len(PAGES)
    killed_at = time.monotonic()
    holder.kill()
    return reader, killed_at


def test_sigkill_of_a_holder_gives_failed_or_miss_never_wrong_bytes(nodes, record_property):
    reader, killed_at = kill_holder(nodes, replicas=1)
    first = reader.call("prefetch", pages=PAGES)
    assert_clean(first)
    counts = Counter(first["statuses"])
    assert set(counts) <= {"ok", "failed", "miss"}, counts
    assert counts["ok"] < len(PAGES), "no object was on the killed process's segment"
    seconds, answers = read_until(reader, lambda s: "failed" not in s, RECOVERY_BOUND_S,
                                  killed_at)
    last = Counter(answers[-1]["statuses"])
    assert last["ok"] + last["miss"] == len(PAGES) and last["miss"] > 0, last
    assert last["ok"] == counts["ok"]  # the survivors' objects stay readable throughout
    record_property("seconds_to_miss", round(seconds, 2))
    print(f"\nreplicas=1: first read {dict(counts)}; lost pages read MISS "
          f"{seconds:.1f} s after the kill; then {dict(last)}")


def test_two_replicas_lose_no_page_when_a_holder_dies(nodes, record_property):
    reader, killed_at = kill_holder(nodes, replicas=2)
    first = reader.call("prefetch", pages=PAGES)
    assert_clean(first)
    seconds, answers = read_until(reader, lambda s: s == ["ok"] * len(PAGES),
                                  RECOVERY_BOUND_S, killed_at)
    assert answers[-1]["bytes"] == len(PAGES) * 4 * 16 * (656 + 132)
    record_property("seconds_to_recovery", round(seconds, 2))
    print(f"\nreplicas=2: first read {dict(Counter(first['statuses']))}; every page exact "
          f"{seconds:.1f} s after the kill")


def in_process_pair(first, second, prefix: str):
    """Evict through ``first``'s node, prefetch through ``second``'s, in this process."""
    a = ClusterNode(first, layers=2, page_tokens=4, resident=8, key_prefix=prefix)
    b = ClusterNode(second, layers=2, page_tokens=4, resident=8, key_prefix=prefix)
    try:
        assert a.evict(range(8))["statuses"] == ["ok"] * 8
        got = b.prefetch(list(range(8)))
        assert got["statuses"] == ["ok"] * 8
        assert_clean(got)
        assert b.prefetch([50, 51])["statuses"] == ["miss", "miss"]
    finally:
        a.mover.close()
        b.mover.close()


def test_two_stores_in_one_process_share_one_master():
    with kvmove.MooncakeStore.embedded(global_segment_size=64 << 20) as first:
        config = kvmove.StoreConfig(master_address=first.address, local_hostname="127.0.0.1",
                                    global_segment_size=64 << 20)
        with kvmove.MooncakeStore(config) as second:
            in_process_pair(first, second, "ab")
            in_process_pair(second, first, "ba")


def test_two_embedded_stores_in_one_process_are_independent():
    with kvmove.MooncakeStore.embedded(global_segment_size=64 << 20) as first, \
            kvmove.MooncakeStore.embedded(global_segment_size=64 << 20) as second:
        assert first.address != second.address
        in_process_pair(first, first, "aa")
        in_process_pair(second, second, "bb")
        # Different masters: what one stored, the other does not know.
        other = ClusterNode(second, layers=2, page_tokens=4, resident=8, key_prefix="pair2")
        mine = ClusterNode(first, layers=2, page_tokens=4, resident=8, key_prefix="pair2")
        try:
            assert mine.evict([1, 2])["statuses"] == ["ok", "ok"]
            assert other.prefetch([1, 2])["statuses"] == ["miss", "miss"]
        finally:
            mine.mover.close()
            other.mover.close()
