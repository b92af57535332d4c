"""Several engine processes on one real master (each a ``kvmove.cli.cluster_node`` process with
its own KV cache, store client and mover; nothing mocked):

- two and four processes: what one evicts, the others prefetch byte-exact; unknown keys read
  ``MISS`` with the rows untouched;
- SIGKILL of a process whose segment holds objects: a reader in another process gets ``OK``
  with exact bytes, ``FAILED`` or ``MISS``, never wrong bytes, its other rows untouched;
  within the master's client TTL (plus a heartbeat) the lost objects read ``MISS``;
- with ``replicas=2``: after the same SIGKILL, every page reads back exact from its
  surviving replica in the first read after the kill (replica failover within the call);
  the time it took is printed (``-s``) and recorded as a test property; the same through a
  metadata server (Mooncake's HTTP one) instead of ``P2PHANDSHAKE``;
- 128 DSA-sized pages (61 layers x 16 tokens x 656 B) evicted by one process into two
  store-only processes and prefetched by another, all ``OK`` and exact (batches cut to
  what the TCP transport carries, with raised and with Mooncake's default queues);
- (long run, ``KVMOVE_CLUSTER_SOAK_SECONDS``) a holder stopped with SIGSTOP: the engine's
  prefetch ends ``FAILED`` at its bound, and the engine stays usable;
- two stores in one process (one master, or two embedded ones) both work.

Every process is bounded by timeouts and exits on its own (``NodeProcess.close``).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import kvmove
from kvmove.cli.cluster_node import ClusterNode, NodeProcess
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S
from kvmove.store.transport_limits import TCP_QUEUE_VARS
from tests.support.holder import Holder

pytestmark = pytest.mark.store

PAGES = list(range(48))
# DSA-sized pages: 61 layers x 16 tokens x 656 B, one span of 10,496 B per layer.
DSA = {"layers": 61, "page_tokens": 16, "rows": {"kv": 656}}
DSA_PAGE_BYTES = 61 * 16 * 656
# Mooncake's own cap on a stuck call (a call not bounded by kvmove returns only after it).
MOONCAKE_CAP_S = 60
UNKNOWN = list(range(1000, 1016))
# The master drops a silent client after its TTL; heartbeats come about every second.
RECOVERY_BOUND_S = DEFAULT_CLIENT_TTL_S + 10


@pytest.fixture
def master():
    with kvmove.EmbeddedMaster() as m:
        yield m


@pytest.fixture
def holders(master, tmp_path):
    """``holders(n)``: ``n`` store-only processes giving the store memory, killed at the end."""
    started: list[Holder] = []

    def start(n: int) -> list[Holder]:
        new = [Holder(master.address, log_path=tmp_path / f"holder{len(started) + i}.log")
               for i in range(n)]
        started.extend(new)
        return new

    yield start
    for h in started:
        h.close()


@pytest.fixture
def nodes(master, tmp_path):
    """``nodes(n, **options)``: ``n`` engine processes on ``master`` (started together),
    closed at the end."""
    started: list[NodeProcess] = []

    def start(n: int, **options) -> list[NodeProcess]:
        first = len(started)
        with ThreadPoolExecutor(n) as pool:
            new = list(pool.map(lambda i: NodeProcess(
                master.address, log_path=tmp_path / f"node{first + i}.log", **options),
                range(n)))
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


def test_128_dsa_pages_evicted_in_one_process_prefetched_in_another(master, holders, nodes):
    # The writer (this process, no segment of its own) uses the raised TCP queues kvmove
    # sets; the reader runs with Mooncake's default queues (1024 + 1024 per peer), so its
    # 7808 spans go in calls of at most 1024: both regimes of the transport's limits.
    holders(2)
    default_queues = {var: "1024" for var in TCP_QUEUE_VARS}
    reader, = nodes(1, segment="0", resident=128, env=default_queues, **DSA)
    store = kvmove.MooncakeStore(kvmove.StoreConfig(
        master_address=master.address, local_hostname="127.0.0.1", global_segment_size=0))
    writer = ClusterNode(store, resident=128, key_prefix="cluster", **DSA)
    try:
        assert store.limits.call_spans >= 2048  # the raised queues are in effect
        pages = list(range(128))
        put = writer.evict(pages)
        assert put["statuses"] == ["ok"] * 128
        got = reader.call("prefetch", pages=pages)
        assert got["statuses"] == ["ok"] * 128
        assert got["bytes"] == 128 * DSA_PAGE_BYTES
        assert_clean(got)
        again = writer.prefetch(pages)  # and back into the writer, every byte checked
        assert again["statuses"] == ["ok"] * 128 and again["bytes"] == 128 * DSA_PAGE_BYTES
        assert_clean(again)
        print(f"\n128 DSA pages: evict {put['seconds']:.2f} s (raised queues), prefetch "
              f"{got['seconds']:.2f} s in another process (default queues)")
    finally:
        writer.close()


@pytest.mark.skipif(not os.environ.get("KVMOVE_CLUSTER_SOAK_SECONDS"),
                    reason="long run (KVMOVE_CLUSTER_SOAK_SECONDS): the core suite has the "
                           "in-process version, tests/store/test_bounded_call.py")
def test_a_stalled_holder_gives_failed_within_the_bound_and_everything_stays_usable(
        holders, nodes):
    bound = 3.0
    _, stalled = holders(2)
    engine, = nodes(1, segment="0", env={"KVMOVE_CALL_TIMEOUT": str(bound)})
    assert engine.call("evict", pages=PAGES)["statuses"] == ["ok"] * len(PAGES)
    slots = engine.call("stats")["slots"]
    stalled.kill(signal.SIGSTOP)
    try:
        # Without the bound this call would return only after Mooncake's 60-s cap.
        got = engine.call("prefetch", pages=PAGES, timeout=MOONCAKE_CAP_S - 15)
        assert_clean(got)  # no wrong bytes; rows of pages not read untouched
        counts = Counter(got["statuses"])
        assert set(counts) <= {"ok", "failed"} and counts["failed"] > 0, counts
        # The get given up may still write into its staging slots: they stay allocated.
        assert engine.call("stats")["free_slots"] < slots
        # Usable: once the master has dropped the stalled holder, new pages go to the
        # live one and read back exact (a replacement client carries the calls).
        time.sleep(DEFAULT_CLIENT_TTL_S + 2)
        fresh = [p + 500 for p in range(8)]
        assert engine.call("evict", pages=fresh, timeout=30)["statuses"] == ["ok"] * 8
        back = engine.call("prefetch", pages=fresh, timeout=30)
        assert back["statuses"] == ["ok"] * 8
        assert_clean(back)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    # Once the holder runs again the stuck get returns and its slots come back.
    deadline = time.monotonic() + 30
    while engine.call("stats")["free_slots"] < slots:
        assert time.monotonic() < deadline, "the slots of the call given up never came back"
        time.sleep(0.5)


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
    # The first read after the kill: the pages whose first-listed replica was on the dead
    # process are read from their live replica within the same call.
    first = reader.call("prefetch", pages=PAGES)
    took = time.monotonic() - killed_at
    assert_clean(first)
    assert first["statuses"] == ["ok"] * len(PAGES), Counter(first["statuses"])
    assert first["bytes"] == len(PAGES) * 4 * 16 * (656 + 132)
    # And the next read too (the master may drop the dead process meanwhile).
    second = reader.call("prefetch", pages=PAGES)
    assert second["statuses"] == ["ok"] * len(PAGES)
    assert_clean(second)
    record_property("seconds_to_first_exact_read", round(took, 2))
    print(f"\nreplicas=2: the first read after the kill: every page exact, "
          f"{first['seconds']:.2f} s for the call, {took:.2f} s after the kill")


def test_two_replicas_lose_no_page_through_a_metadata_server(metadata_server, nodes):
    """The same failover with the engines named through Mooncake's HTTP metadata server
    (``MOONCAKE_TE_META_DATA_SERVER``) instead of ``P2PHANDSHAKE``: every store client, and
    the reader's replica reader beside its own client, get names of their own on one host."""
    reader, _ = kill_holder(nodes, replicas=2)
    first = reader.call("prefetch", pages=PAGES)
    assert_clean(first)
    assert first["statuses"] == ["ok"] * len(PAGES), Counter(first["statuses"])


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
