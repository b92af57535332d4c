"""What the end-to-end checksum costs: ``KVMover`` evict + prefetch with ``checksum=True``
against the same mover without it (``path="staged"``: the one difference is the checksum),
and against the default ``path="auto"`` mover (which may move in place, which the checksum
rules out). 61 layers of 656-byte rows, 32 pages of 1 and of 64 tokens, stacked and
per-layer caches. The movers run in an order that changes each repeat (a Williams square),
one fresh set of keys per call; medians, and the spread (max - min) / median. Also timed
alone: the checksum's own work (``PageChecksum.write`` + ``matches``) on a staging.

    python -m bench.bench_checksum                  # table
    python -m bench.bench_checksum --json out.json  # and the figures as JSON
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results
from bench.timing import repeat_order
from kvmove.objects.checksum import TRAILER_BYTES, PageChecksum

GOAL = 1.05  # evict + prefetch with the checksum / without, on the CPU
MOVERS = ("staged", "checksum", "auto")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_checksum", description=__doc__)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--pages", type=int, default=32, help="pages per call")
    p.add_argument("--page-tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--caches", nargs="+", choices=["stacked", "per_layer"],
                   default=["stacked", "per_layer"])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="fewer layers and repeats")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def make_cache(layers: int, slots: int, row_bytes: int, cache: str) -> kvmove.KVCache:
    g = torch.Generator().manual_seed(0)
    stacked = torch.randint(0, 256, (layers, slots, row_bytes), dtype=torch.uint8, generator=g)
    return kvmove.KVCache({"kv": stacked if cache == "stacked" else list(stacked.unbind(0))})


def spread(samples: list[float]) -> float:
    m = statistics.median(samples)
    return (max(samples) - min(samples)) / m if m else 0.0


def run_case(store, args, cache: str, page_tokens: int) -> dict:
    n, p = args.pages, page_tokens
    kv = make_cache(args.layers, 2 * n * p, args.row_bytes, cache)
    src = torch.arange(n * p).reshape(n, p)
    dst = src + n * p
    common = {"page_tokens": p, "staging_slots": n, "key_prefix": "bench-ck"}
    movers = {"staged": kvmove.KVMover(kv, store, path="staged", **common),
              "checksum": kvmove.KVMover(kv, store, checksum=True, **common),
              "auto": kvmove.KVMover(kv, store, **common)}
    # The checksum alone, on a staging of its own holding the same pages.
    staging = kvmove.StagingBuffer(kv, num_slots=n, page_tokens=p, trailer_bytes=TRAILER_BYTES)
    slots, valid = torch.arange(n), torch.full((n,), p)
    kvmove.gather(kv, staging, src, slots)
    check = PageChecksum(staging)
    samples: dict[str, list[float]] = {}
    try:
        for r in range(args.repeat + 1):  # round 0 warms up and is dropped
            for name in repeat_order([*MOVERS, "checksum alone"], r):
                if name == "checksum alone":
                    t0 = time.perf_counter()
                    check.write(slots, valid)
                    assert bool(check.matches(slots, valid).all())
                    samples.setdefault(name, []).append(time.perf_counter() - t0)
                    continue
                mover, keys = movers[name], [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                assert all(s.ok for s in mover.evict(keys, src).wait(120)), name
                t1 = time.perf_counter()
                assert all(s.ok for s in mover.prefetch(keys, dst).wait(120)), name
                t2 = time.perf_counter()
                for what, s in (("evict", t1 - t0), ("prefetch", t2 - t1),
                                ("evict + prefetch", t2 - t0)):
                    samples.setdefault(f"{what} ({name})", []).append(s)
                store.remove(mover.keyspace.store_keys(keys), force=True)
            if r == 0:
                samples.clear()
        paths = {k: m.path for k, m in movers.items()}
    finally:
        for m in movers.values():
            m.close()
        staging.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    both = "evict + prefetch"
    paired = [a / b for a, b in zip(samples[f"{both} (checksum)"], samples[f"{both} (staged)"],
                                    strict=True)]
    ratio = med[f"{both} (checksum)"] / med[f"{both} (staged)"]
    share = med["checksum alone"] / med[f"{both} (staged)"]
    return {
        "cache": cache, "page_tokens": p, "pages": n, "layers": args.layers,
        "row_bytes": args.row_bytes, "object_bytes": staging.object_bytes,
        "repeats": args.repeat, "paths": paths,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "spread": {k: spread(v) for k, v in samples.items()},
        "ratio": ratio,  # evict + prefetch, checksum / staged without, medians
        "paired_ratio_range": [min(paired), max(paired)],
        "alone_share": share,  # the checksum's own work / staged evict + prefetch
        "vs_auto": med[f"{both} (checksum)"] / med[f"{both} (auto)"],
        "goal": GOAL, "met": ratio <= GOAL,
    }


def run(args) -> dict:
    torch.manual_seed(0)
    cases = []
    with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
        for p in args.page_tokens:
            for cache in args.caches:
                cases.append(run_case(store, args, cache, p))
    return {"benchmark": "bench_checksum", "device": "cpu", "goal": GOAL, "cases": cases}


def report(result: dict, console: Console) -> None:
    table = Table(title=f"checksum cost: evict + prefetch with checksum / without (goal <= "
                        f"{result['goal']:g}x), medians, spread = (max - min) / median")
    for col in ("cache", "page tokens", "MiB/call", "staged ms", "checksum ms", "auto ms",
                "ratio", "paired range", "alone ms", "alone share", "spread", "auto path",
                "met"):
        table.add_column(col, justify="right")
    for c in result["cases"]:
        ms, sp, b = c["median_ms"], c["spread"], "evict + prefetch"
        noise = max(sp[f"{b} (staged)"], sp[f"{b} (checksum)"])
        lo, hi = c["paired_ratio_range"]
        table.add_row(c["cache"], str(c["page_tokens"]),
                      f"{c['pages'] * c['object_bytes'] / 2**20:.1f}",
                      f"{ms[f'{b} (staged)']:.1f}", f"{ms[f'{b} (checksum)']:.1f}",
                      f"{ms[f'{b} (auto)']:.1f}", f"{c['ratio']:.3f}x",
                      f"{lo:.2f}-{hi:.2f}", f"{ms['checksum alone']:.2f}",
                      f"{c['alone_share'] * 100:.1f}%", f"{noise:.2f}",
                      f"{c['paths']['auto']}", "yes" if c["met"] else "no")
    console.print(table, width=200)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.layers, args.repeat = min(args.layers, 16), min(args.repeat, 3)
    return results.finish_suite(run(args), report, args.json)


if __name__ == "__main__":
    sys.exit(main())
