"""Faults under traffic, across processes: a master (here), two holder processes giving the
store memory, one engine process (:mod:`kvmove.cli.cluster_node`, no segment of its own,
``replicas=2``) evicting and prefetching without pause, while holders are SIGKILLed at
random times (each replaced by a new one) and the master is SIGKILLed and restarted once.

Checked on every call: no wrong byte (every page read ``ok`` holds exactly its bytes; the
rows of pages not read are untouched), no page lost that had a live replica (a page is
expected ``ok`` when it was stored in this master's lifetime and some holder of its
replicas, as the master listed them right after the evict, was not killed before the read
ended), every call answered within the bound (the node's call timeout is below Mooncake's
own 60-s cap), and the engine's resident memory flat. Figures (cycles, kills, bytes
compared, worst call time, memory) are printed at the end.

``KVMOVE_CLUSTER_SOAK_SECONDS`` sets the duration (default 12: the core suite's short run);
the closing note's figures come from ``KVMOVE_CLUSTER_SOAK_SECONDS=300``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

import kvmove
from kvmove.cli.cluster_node import NodeProcess
from kvmove.store.clients import LATE_CLOSE_WAIT_S
from tests.support.holder import Holder
from tests.support.process_table import wait_gone

pytestmark = [pytest.mark.soak, pytest.mark.store]

SECONDS = float(os.environ.get("KVMOVE_CLUSTER_SOAK_SECONDS", "12"))
CALL_TIMEOUT_S = 10.0  # the engine's StoreConfig.call_timeout (the default)
ANSWER_BOUND_S = 45.0  # every engine call answers within this (Mooncake's own cap is 60 s)
RSS_GROWTH_BOUND = 64 << 20  # engine memory growth allowed after warm-up
KILL_EVERY_S = (3.0, 6.0)  # a holder is SIGKILLed every so often (uniform)
PAGE_IDS = 3000  # the key space: a page id is stored once (EXISTS after) until lost
GEOMETRY = {"layers": 8, "page_tokens": 16, "resident": 48}
PAGE_BYTES = 8 * 16 * (656 + 132)


@dataclass
class World:
    """What the faults did, as the test process saw them (``time.monotonic()``)."""

    holders: list[Holder] = field(default_factory=list)
    killed_at: dict[int, float] = field(default_factory=dict)  # holder pid -> kill time
    master_epochs: list[float] = field(default_factory=lambda: [0.0])  # restart times
    lock: threading.Lock = field(default_factory=threading.Lock)

    def holder_of(self, endpoint: str) -> Holder | None:
        with self.lock:
            return next((h for h in self.holders if endpoint in h.endpoints), None)

    def epoch(self, t: float) -> int:
        with self.lock:
            return sum(1 for r in self.master_epochs if r <= t) - 1

    def survives(self, endpoints: list[str], until: float) -> bool:
        """Whether a holder of ``endpoints`` was not killed before ``until``."""
        for e in endpoints:
            h = self.holder_of(e)
            if h is not None and self.killed_at.get(h.pid, float("inf")) > until:
                return True
        return False


@dataclass
class Record:
    replicas: list[str]
    stored_at: float


def faults(world: World, master: kvmove.EmbeddedMaster, stop: threading.Event,
           tmp_path, rng: random.Random, counts: Counter) -> None:
    """SIGKILL a random holder every few seconds and start a new one; restart the master
    once, near the middle of the run."""
    restart_at = time.monotonic() + SECONDS * 0.45
    while not stop.wait(rng.uniform(*KILL_EVERY_S)):
        if not counts["master_restarts"] and time.monotonic() >= restart_at:
            # The time of the kill, not of its end: a read that ends in between already
            # finds no master (its keys RPC_FAIL).
            pid, killed = master.pid, time.monotonic()
            with world.lock:
                world.master_epochs.append(killed)
            os.kill(pid, signal.SIGKILL)
            assert wait_gone(pid, 10)
            master.restart()
            counts["master_restarts"] += 1
            continue
        with world.lock:
            live = [h for h in world.holders if h.alive()]
        victim = rng.choice(live)
        with world.lock:  # before the kill, as the master's
            world.killed_at[victim.pid] = time.monotonic()
        victim.kill()
        counts["kills"] += 1
        new = Holder(master.address, log_path=tmp_path / f"holder{len(world.holders)}.log")
        with world.lock:
            world.holders.append(new)


def test_holders_killed_and_master_restarted_under_traffic(tmp_path, capsys):
    rng = random.Random(2121)
    world = World()
    counts: Counter = Counter()
    stop = threading.Event()
    with kvmove.EmbeddedMaster() as master:
        world.holders += [Holder(master.address, log_path=tmp_path / f"holder{i}.log")
                          for i in range(2)]
        engine_log = tmp_path / "engine.log"
        engine = NodeProcess(master.address, log_path=engine_log, replicas=2, segment="0",
                             timeout=ANSWER_BOUND_S,
                             env={"KVMOVE_CALL_TIMEOUT": str(CALL_TIMEOUT_S)}, **GEOMETRY)
        stored: dict[int, Record] = {}
        worst = {"evict": 0.0, "prefetch": 0.0}
        rss: list[int] = []
        killer = threading.Thread(target=faults, name="soak-faults", daemon=True,
                                  args=(world, master, stop, tmp_path, rng, counts))
        try:
            t_end = time.monotonic() + SECONDS
            killer.start()
            while time.monotonic() < t_end:
                counts["cycles"] += 1
                # -- evict: pages not stored (or lost), their replicas listed right after
                fresh = rng.sample([p for p in range(PAGE_IDS) if p not in stored], 16)
                t0 = time.monotonic()
                put = engine.call("evict", pages=fresh, where=True)
                worst["evict"] = max(worst["evict"], time.monotonic() - t0)
                for page, status, where in zip(fresh, put["statuses"], put["replicas"],
                                               strict=True):
                    counts[f"evict_{status}"] += 1
                    if status in ("ok", "exists") and where:
                        stored[page] = Record(where, t0)
                    else:
                        stored.pop(page, None)
                # -- prefetch: stored pages, and two never stored
                known = rng.sample(sorted(stored), min(len(stored), 30))
                unknown = [PAGE_IDS + rng.randrange(10**6) for _ in range(2)]
                t0 = time.monotonic()
                got = engine.call("prefetch", pages=known + unknown)
                t1 = time.monotonic()
                worst["prefetch"] = max(worst["prefetch"], t1 - t0)
                assert got["wrong"] == [], f"wrong bytes for pages {got['wrong']}"
                assert got["touched"] == [], f"rows written for pages {got['touched']}"
                counts["bytes_compared"] += got["bytes"]
                for page, status in zip(known + unknown, got["statuses"], strict=True):
                    counts[f"read_{status}"] += 1
                    if page in unknown:
                        assert status != "ok", page
                        continue
                    record = stored[page]
                    expected = (world.epoch(record.stored_at) == world.epoch(t1)
                                and world.survives(record.replicas, t1))
                    if expected:
                        counts["reads_with_a_live_replica"] += 1
                        assert status == "ok", (
                            f"page {page} read {status!r} although a holder of its replicas "
                            f"{record.replicas} was alive (stored at {record.stored_at:.1f}, "
                            f"read {t0:.1f}-{t1:.1f}, kills {world.killed_at})")
                    elif status != "ok":
                        stored.pop(page, None)  # lost: it may be stored again
                if counts["cycles"] in (5, 10) or time.monotonic() >= t_end:
                    rss.append(engine.call("stats")["rss"])
            rss.append(engine.call("stats")["rss"])
        finally:
            stop.set()
            killer.join(30)
            # a put given up at the bound may still be in Mooncake: the engine's store waits
            # up to LATE_CLOSE_WAIT_S for it at close (a kill before then is not a clean exit)
            code = engine.close(timeout=LATE_CLOSE_WAIT_S + 15)
            for h in world.holders:
                h.close()
        assert code == 0
    log = engine_log.read_text(errors="replace")
    failover = sum(int(m) for m in re.findall(r"replica failover: (\d+) of", log))
    given_up = log.count("gave no answer within")
    base = rss[1] if len(rss) > 2 else rss[0]  # after warm-up
    growth = rss[-1] - base
    assert counts["kills"] >= 1 and counts["reads_with_a_live_replica"] > 0, counts
    assert growth < RSS_GROWTH_BOUND, f"engine memory grew {growth / 2**20:.1f} MiB: {rss}"
    with capsys.disabled():
        print(f"\n[cluster soak] {SECONDS:.0f} s: {counts['cycles']} cycles, "
              f"{counts['kills']} holder kills, {counts['master_restarts']} master restart; "
              f"evicts {dict((k[6:], v) for k, v in counts.items() if k.startswith('evict_'))}; "
              f"reads {dict((k[5:], v) for k, v in counts.items() if k.startswith('read_'))}; "
              f"{counts['reads_with_a_live_replica']} reads of pages with a live replica, all "
              f"exact; {failover} keys read from a surviving replica within the call; "
              f"{given_up} calls given up at the bound; {counts['bytes_compared'] / 2**20:.1f} "
              f"MiB compared, 0 wrong; worst call: evict {worst['evict']:.2f} s, prefetch "
              f"{worst['prefetch']:.2f} s; engine RSS {base / 2**20:.0f} -> "
              f"{rss[-1] / 2**20:.0f} MiB after warm-up")
