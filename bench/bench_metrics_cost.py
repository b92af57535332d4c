"""What metrics cost a caller: the host time of one ``KVMover.evict`` / ``prefetch`` call
(its return, on the caller's thread) with kvmove's metrics off against on, on one mover and
one embedded master, interleaved round by round (the order of off and on alternating), plus
``kvmove.gather`` (no hook on its path: a control, it must show no cost) and the caller's
hooks alone (``record.clock`` + ``record.call_done``, per call of a batch). Goal: on adds
at most 2 µs a call (``docs/METRICS.md``); a figure whose rounds spread wider than the goal
does not resolve it (``resolved``). Each figure is the median over rounds of each
round's median call; the added time is the median of the rounds' paired differences, with
their range: the run's spread.

    python -m bench.bench_metrics_cost                  # table
    python -m bench.bench_metrics_cost --json out.json  # and the figures as JSON
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import machine, results
from kvmove import metrics
from kvmove.metrics import record

GOAL_US = 2.0
OPS = ("evict", "prefetch", "gather", "hooks")
HOOK_CALLS = 1000  # the hooks alone: timed in batches of this many


def build_parser() -> argparse.ArgumentParser:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench.bench_metrics_cost", description=__doc__)
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--layers", type=int, default=61 if on_gpu else 8)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--pages", type=int, default=4, help="pages per call")
    p.add_argument("--rounds", type=int, default=15, help="rounds of off and on")
    p.add_argument("--calls", type=int, default=200, help="calls per op, mode and round")
    p.add_argument("--quick", action="store_true", help="5 rounds of 60 calls")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


class Calls:
    """One mover's calls, each timed alone (return time, ns); its transfer waited for
    untimed. The keys are stored once and evicted again (the put finds them: no store
    growth), so every call of a mode does the same work."""

    def __init__(self, args, store):
        device = torch.device(args.device)
        pages, pt = args.pages, args.page_tokens
        self.kv = kvmove.KVCache({"kv": torch.randint(
            0, 256, (args.layers, 2 * pages * pt, args.row_bytes), dtype=torch.uint8,
            device=device)})
        self.mover = kvmove.KVMover(self.kv, store, page_tokens=pt, staging_slots=2 * pages,
                                    key_prefix=f"bench-metrics-{time.time_ns()}",
                                    path="staged")
        self.src = torch.arange(pages * pt).reshape(pages, pt)
        self.dst = self.src + pages * pt
        self.keys = [f"p{i}" for i in range(pages)]
        self.staging = self.mover.staging
        self.slots = torch.arange(pages)
        backend = "torch" if device.type == "cpu" else "auto"
        self._gather = lambda: kvmove.gather(self.kv, self.staging, self.src, self.slots,
                                             backend=backend)
        assert self.mover.evict(self.keys, self.src).wait(60) == [kvmove.Status.OK] * pages
        self.device = device

    def one(self, op: str) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter_ns()
        if op == "hooks":
            for _ in range(HOOK_CALLS):
                record.call_done("evict", record.clock())
            return (time.perf_counter_ns() - t0) // HOOK_CALLS
        if op == "evict":
            t = self.mover.evict(self.keys, self.src)
        elif op == "prefetch":
            t = self.mover.prefetch(self.keys, self.dst)
        else:
            self._gather()
            return time.perf_counter_ns() - t0
        took = time.perf_counter_ns() - t0
        t.wait(60)
        return took

    def close(self) -> None:
        self.mover.close()


def run(args) -> dict:
    registry = __import__("prometheus_client").CollectorRegistry()
    per_round = {(op, mode): [] for op in OPS for mode in ("off", "on")}
    with kvmove.MooncakeStore.embedded() as store:
        calls = Calls(args, store)
        try:
            for op in OPS:  # warm: both modes once
                for mode in ("off", "on"):
                    _batch(calls, op, mode, registry, 20)
            for r in range(args.rounds):
                modes = ("off", "on") if r % 2 == 0 else ("on", "off")
                for op in OPS:
                    for mode in modes:
                        per_round[op, mode].append(_batch(calls, op, mode, registry,
                                                          args.calls))
        finally:
            calls.close()
            metrics.disable()
    rows = []
    for op in OPS:
        off, on = per_round[op, "off"], per_round[op, "on"]
        diffs = [b - a for a, b in zip(off, on, strict=True)]
        added = statistics.median(diffs)
        q1, _, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (added,) * 3
        rows.append({
            "op": op, "off_us": statistics.median(off), "on_us": statistics.median(on),
            "off_spread": (max(off) - min(off)) / statistics.median(off),
            "added_us": added, "added_min_us": min(diffs), "added_max_us": max(diffs),
            "added_q1_us": q1, "added_q3_us": q3,
            "goal_us": GOAL_US, "met": added <= GOAL_US,
            # the middle half of the rounds' differences within the goal's width
            "resolved": (q3 - q1) / 2 <= GOAL_US,
        })
    return {"benchmark": "bench_metrics_cost", "device": str(calls.device),
            "layers": args.layers, "row_bytes": args.row_bytes,
            "page_tokens": args.page_tokens, "pages": args.pages, "rounds": args.rounds,
            "calls": args.calls, "machine": machine.describe(calls.device)["title"],
            "date": results.today(),
            "rows": rows}


def _batch(calls: Calls, op: str, mode: str, registry, n: int) -> float:
    """Median µs of ``n`` calls of ``op`` with metrics ``mode``."""
    if mode == "on":
        metrics.enable(registry)
    else:
        metrics.disable()
    took = [calls.one(op) for _ in range(n if op != "hooks" else max(1, n // 20))]
    return statistics.median(took) / 1e3


def report(result: dict, console: Console) -> None:
    table = Table(title=f"metrics off vs on: host time of one call ({result['machine']}, "
                        f"{result['layers']} layers x {result['row_bytes']} B, "
                        f"{result['pages']} pages of {result['page_tokens']} tokens; "
                        f"medians of {result['rounds']} interleaved rounds of "
                        f"{result['calls']} calls)")
    for col in ("call", "off µs", "on µs", "added µs", "added IQR µs", "added range µs",
                "off spread", "goal", "met", "resolved"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(r["op"], f"{r['off_us']:.1f}", f"{r['on_us']:.1f}",
                      f"{r['added_us']:+.2f}", f"{r['added_q1_us']:+.1f} .. "
                      f"{r['added_q3_us']:+.1f}", f"{r['added_min_us']:+.1f} .. "
                      f"{r['added_max_us']:+.1f}", f"{r['off_spread']:.0%}",
                      f"≤ +{r['goal_us']:g} µs", "yes" if r["met"] else "NO",
                      "yes" if r["resolved"] else "no: noise")
    console.print(table)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.calls = 5, 60
    for name in ("rounds", "calls", "pages", "layers", "page_tokens", "row_bytes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    result = run(args)
    result["command"] = " ".join(["python -m bench.bench_metrics_cost", shlex.join(
        sys.argv[1:] if argv is None else argv)]).rstrip()
    report(result, Console(width=160))  # wide enough for every column on any terminal
    if args.json is not None:
        results.save(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
