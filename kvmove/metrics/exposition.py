"""The ``kvmove_*`` families as Prometheus sees them, built from the tallies at scrape time
(a ``prometheus_client`` collector): names, units and labels in ``docs/METRICS.md``."""

from __future__ import annotations

from kvmove.metrics.tallies import Tallies


class TalliesCollector:
    """A ``prometheus_client`` collector of one :class:`Tallies`."""

    def __init__(self, tallies: Tallies):
        self.tallies = tallies

    def describe(self):
        return []  # built at scrape time only: nothing to check at registration

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        t = self.tallies
        with t.lock:
            nbytes, seconds = dict(t.bytes), dict(t.seconds)
            keys, results = dict(t.keys), dict(t.results)
            paths, failover = dict(t.paths), dict(t.failover_keys)
        stage = ["direction", "stage"]
        moved = CounterMetricFamily("kvmove_bytes", "Bytes of the keys that ended OK, by "
                                    "direction and stage", labels=stage)
        took = CounterMetricFamily("kvmove_stage_seconds", "Seconds the stages that moved "
                                   "those bytes took", labels=stage)
        rate = GaugeMetricFamily("kvmove_throughput_bytes_per_second", "kvmove_bytes_total "
                                 "over kvmove_stage_seconds_total, since metrics were enabled",
                                 labels=stage)
        for label in sorted(nbytes):
            moved.add_metric(label, nbytes[label])
            took.add_metric(label, seconds[label])
            rate.add_metric(label, nbytes[label] / seconds[label])
        yield from (moved, took, rate)
        statuses = CounterMetricFamily("kvmove_keys", "Keys by direction, kvmove Status and "
                                       "the store's raw code", labels=["direction", "status",
                                                                       "code"])
        for label in sorted(keys):
            statuses.add_metric(label, keys[label])
        yield statuses
        pieces = CounterMetricFamily("kvmove_results", "Finished pieces of calls (a call "
                                     "larger than the staging is several)", labels=["direction"])
        for label in sorted(results):
            pieces.add_metric([label], results[label])
        yield pieces
        host = HistogramMetricFamily("kvmove_call_host_seconds", "Host time of one call on "
                                     "the caller's thread", labels=["op"])
        for op, buckets in t.call_ns.items():
            host.add_metric([op], *buckets.snapshot())
        yield host
        copy = HistogramMetricFamily("kvmove_copy_seconds", "Time of one copy between KV "
                                     "rows and staging", labels=["stage"])
        for name, buckets in t.copy_seconds.items():
            copy.add_metric([name], *buckets.snapshot())
        yield copy
        grid = HistogramMetricFamily("kvmove_copy_max_programs", "The program cap (SMs) "
                                     "of each Triton copy launch's config")
        grid.add_metric([], *t.programs.snapshot())
        yield grid
        used, total = t.staging_in_use()
        yield GaugeMetricFamily("kvmove_staging_slots_in_use", "Staging slots allocated, "
                                "over live movers", value=used)
        yield GaugeMetricFamily("kvmove_staging_slots", "Staging slots of live movers",
                                value=total)
        movers = CounterMetricFamily("kvmove_movers", "Movers built, by direction and the "
                                     "path chosen", labels=["direction", "path"])
        for label in sorted(paths):
            movers.add_metric(label, paths[label])
        yield movers
        replicas = CounterMetricFamily("kvmove_failover_keys", "Keys whose holder failed "
                                       "(tried) and those read from a live replica "
                                       "(recovered)", labels=["outcome"])
        for outcome in ("tried", "recovered"):
            replicas.add_metric([outcome], failover[outcome])
        yield replicas
