"""What kvmove records while metrics are on: totals by label, updated on the thread that
knows them (workers for results, the caller for its host time), read at scrape time."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

from kvmove.metrics.histogram import PROGRAMS_BUCKETS, SECONDS_BUCKETS, Buckets
from kvmove.status import Status, code_name

# Per direction, the stages of a result's times: (attribute of its times, stage label).
STAGES = {
    "evict": (("gather", "gather"), ("put", "put")),
    "prefetch": (("get", "get"), ("scatter", "scatter")),
    "send": (("gather", "gather"), ("put", "send")),
}
COPY_STAGES = frozenset({"gather", "scatter"})  # the copies between KV rows and staging


class Tallies:
    """Every ``kvmove_*`` family's values (``docs/METRICS.md``). Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)  # (direction, stage)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.keys: dict[tuple[str, str, str], int] = defaultdict(int)  # (dir, status, code)
        self.results: dict[str, int] = defaultdict(int)  # direction -> results counted
        self.call_ns: dict[str, Buckets] = {  # observed in ns, exported in seconds
            op: Buckets(SECONDS_BUCKETS, scale=1e-9) for op in ("evict", "prefetch", "send")}
        self.copy_seconds: dict[str, Buckets] = {
            stage: Buckets(SECONDS_BUCKETS) for stage in sorted(COPY_STAGES)}
        self.programs = Buckets(PROGRAMS_BUCKETS)
        self.failover_keys: dict[str, int] = {"tried": 0, "recovered": 0}
        self.paths: dict[tuple[str, str], int] = defaultdict(int)  # (direction, path) movers
        self.stagings: weakref.WeakSet = weakref.WeakSet()

    def add_result(self, direction: str, result) -> None:
        """A finished piece (``statuses``, ``codes``, ``nbytes`` of the OK keys, ``times``):
        its bytes go to each stage that took time, with that time."""
        times, nbytes, statuses = result.times, result.nbytes, result.statuses
        stage_times = [(stage, getattr(times, attr)) for attr, stage in STAGES[direction]]
        all_ok = statuses.count(Status.OK) == len(statuses)
        with self.lock:
            self.results[direction] += 1
            for stage, secs in stage_times:
                if secs > 0:
                    self.bytes[direction, stage] += nbytes
                    self.seconds[direction, stage] += secs
            if all_ok:
                if statuses:
                    self.keys[direction, "OK", "OK"] += len(statuses)
            else:
                for st, code in zip(statuses, result.codes, strict=True):
                    self.keys[direction, st.name, "OK" if st.ok else code_name(code)] += 1
        for stage, secs in stage_times:
            if secs > 0 and stage in COPY_STAGES:
                self.copy_seconds[stage].observe(secs)

    def add_failover(self, tried: int, recovered: int) -> None:
        with self.lock:
            self.failover_keys["tried"] += tried
            self.failover_keys["recovered"] += recovered

    def add_mover(self, staging, evict_path: str, prefetch_path: str) -> None:
        with self.lock:
            self.paths["evict", evict_path] += 1
            self.paths["prefetch", prefetch_path] += 1
            self.stagings.add(staging)

    def staging_in_use(self) -> tuple[int, int]:
        """Slots allocated and slots in all, over the live movers' staging."""
        with self.lock:
            stagings = list(self.stagings)
        used = total = 0
        for s in stagings:
            if getattr(s, "closed", False):
                continue
            total += s.num_slots
            used += s.num_slots - s.num_free
        return used, total
