"""The connector's figures through vLLM's connector stats (``KVConnectorStats``, its
Prometheus hook ``KVConnectorPromMetrics``), under the names of vLLM's offloading connector
where they mean the same: bytes saved (``store``) and loaded (``load``) and the seconds
those bytes took (``docs/METRICS.md``, "vLLM"). vLLM is imported here only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmove.status import Status

# data key -> (vLLM metric name, documentation)
COUNTERS = {
    "store_bytes": ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload "
                    "storage (kvmove: bytes of the blocks saved OK)."),
    "store_time": ("vllm:kv_offload_store_time", "Total store time from GPU to offload "
                   "storage, in seconds (kvmove: gather + put)."),
    "load_bytes": ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage "
                   "to GPU (kvmove: bytes of the blocks loaded OK)."),
    "load_time": ("vllm:kv_offload_load_time", "Total load time from offload storage to "
                  "GPU, in seconds (kvmove: get + scatter)."),
}
KEYS_METRIC = "vllm:kvmove_keys"  # blocks by direction and kvmove Status


@dataclass
class KVMoveConnectorStats(KVConnectorStats):
    """Sums since the last report: the :data:`COUNTERS` keys, and ``keys``:
    ``{STATUS name: blocks}`` (saves and loads together). Serializable (plain dicts and
    numbers)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {**dict.fromkeys(COUNTERS, 0), "keys": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        keys = self.data["keys"]
        for label, n in other.data.get("keys", {}).items():
            keys[label] = keys.get(label, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out = {name: d[name] for name in COUNTERS}
        for side in ("store", "load"):  # bytes over the time those bytes took
            secs = d[f"{side}_time"]
            out[f"{side}_GBps"] = round(d[f"{side}_bytes"] / secs / 1e9, 3) if secs else 0
        return {**out, **{f"keys:{k}": v for k, v in sorted(d["keys"].items())}}

    def is_empty(self) -> bool:
        return not (any(self.data.get(name) for name in COUNTERS) or self.data.get("keys"))


class StatsSince:
    """A worker's mover totals (``KVMover.stats()``) turned into the stats of the interval
    since the last :meth:`take`."""

    def __init__(self):
        self._last = None

    def take(self, mover) -> KVMoveConnectorStats | None:
        if mover is None:
            return None
        now, last = mover.stats(), self._last
        self._last = now
        if last is None:
            last = type(now)(statuses={s: 0 for s in Status})
        stats = KVMoveConnectorStats()
        d = stats.data
        d["store_bytes"] = now.bytes_put - last.bytes_put
        d["store_time"] = (now.gather_s + now.put_s) - (last.gather_s + last.put_s)
        d["load_bytes"] = now.bytes_got - last.bytes_got
        d["load_time"] = (now.get_s + now.scatter_s) - (last.get_s + last.scatter_s)
        # MoverStats counts statuses over both directions
        for status, n in now.statuses.items():
            delta = n - last.statuses.get(status, 0)
            if delta:
                d["keys"][status.name] = delta
        return None if stats.is_empty() else stats


class KVMovePromMetrics(KVConnectorPromMetrics):
    """vLLM's Prometheus hook: one counter per :data:`COUNTERS` entry and the blocks by
    status, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=metric, documentation=doc, labelnames=labelnames)
            for name, (metric, doc) in COUNTERS.items()}
        self._keys = self._counter_cls(name=KEYS_METRIC, documentation="Blocks saved and "
                                       "loaded, by kvmove Status", labelnames=[*labelnames,
                                                                              "status"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value > 0:
                counter.labels(*labels).inc(value)
        for status, n in transfer_stats_data.get("keys", {}).items():
            self._keys.labels(*labels, status).inc(n)
