"""The fixed cost of one call: ``kvmove.gather`` / ``kvmove.scatter`` of a few pages, called
back to back (warm, as in an engine's step loop), against the copy it makes, made plainly on
the same data with everything prepared beforehand: on a CPU the torch primitive calls the
torch backend makes (:func:`bench.baselines.primitive_units`); on a GPU one launch of the
same Triton kernel through its launcher. The difference is what kvmove's checks, planning
and dispatch cost per call.

The same run measures the figures of an engine's decode step
(:mod:`bench.bench_hot_path`): one-page gather/scatter against the plain ops, the return time
of ``KVMover.prefetch``, layer-wise against whole-cache prefetch, and a CPU gather with every
core busy against a per-row ``memmove`` loop.

    python -m bench.bench_calls                  # table
    python -m bench.bench_calls --json out.json  # and the figures as JSON
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import baselines, bench_hot_path, results
from bench.cases import Case
from bench.workload import Workload


def build_parser() -> argparse.ArgumentParser:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench.bench_calls", description=__doc__)
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--layers", type=int, default=61 if on_gpu else 8)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--page-tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--pages", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--caches", nargs="+", choices=bench_hot_path.CACHES,
                   default=list(bench_hot_path.CACHES),
                   help="how the KV cache is given: one stacked tensor, per-layer tensors "
                        "(on a GPU the call table uses a stacked cache, the hot path these)")
    p.add_argument("--repeat", type=int, default=9, help="timed batches per method")
    p.add_argument("--batch-ms", type=float, default=20.0, help="length of one timed batch")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter batches")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call(fns: dict[str, Callable[[], object]], device: torch.device, *, repeat: int,
             batch_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in batches of back-to-back calls
    (the batch sized to about ``batch_s``), the functions interleaved batch by batch."""
    sizes = {}
    for name, fn in fns.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        sizes[name] = max(1, min(10_000, int(batch_s / max(time.perf_counter() - t0, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            k = sizes[name]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / k)
    return {name: statistics.median(s) for name, s in samples.items()}


def _gpu_case(case: Case, device: torch.device):
    """``(kvmove calls, plain copy, close)`` of a case on a GPU: the tuner's workload (whole
    KV pages in a random order into staging slots 0..n-1) and one launch of the kernel with
    the config kvmove would pick, every argument prepared."""
    from kvmove.rows.launch_config import pick
    from kvmove.tuning.workload import Workload as TuningWorkload

    w = TuningWorkload(device, case.row_bytes, case.page_tokens, layers=case.layers,
                        target_bytes=case.nbytes)
    config = pick(case.direction, case.row_bytes, case.page_tokens,
                  torch.cuda.get_device_name(device))
    launch = w.launcher(case.direction)
    calls = _kvmove_calls(w.kv, w.staging, w.token_pages, w.slots, case.direction, "triton")
    # The same call on indices already on the GPU (an engine's own index tensors).
    on_device = _kvmove_calls(w.kv, w.staging, w.token_pages.to(device), w.slots.to(device),
                              case.direction, "triton")
    calls["kvmove device"] = on_device["kvmove unchecked"]
    return calls, (lambda: launch(config)), w.close


def _cpu_case(case: Case, w: Workload):
    """``(kvmove calls, plain copy)`` of a case on the CPU: the torch primitive calls the
    torch backend makes. Each one's bytes are checked first."""
    token_pages, slots, _ = w.indices(case.pages)
    plain = baselines.primitive_units(w, case)
    calls = _kvmove_calls(w.kv, w.staging, token_pages, slots, case.direction, "torch")
    for fn in (*calls.values(), plain[0]):  # each writes the right bytes
        w.poison(case.direction, case.pages)
        fn()
        w.check(case.direction, case.pages)
    return calls, plain[0]


def _kvmove_calls(kv, staging, token_pages, slots, direction: str, backend: str) -> dict:
    """The public call, checked (the default) and with ``check=False``, on ``backend`` (the
    path the plain copy takes, so that only kvmove's own work differs)."""
    if direction == "gather":
        return {f"kvmove{tag}": (lambda c=check: kvmove.gather(kv, staging, token_pages, slots,
                                                               backend=backend, check=c))
                for tag, check in (("", True), (" unchecked", False))}
    return {f"kvmove{tag}": (lambda c=check: kvmove.scatter(staging, slots, kv, token_pages,
                                                            backend=backend, check=c))
            for tag, check in (("", True), (" unchecked", False))}


def _record(case: Case, cache: str, t: dict[str, float]) -> dict:
    us = {name: seconds * 1e6 for name, seconds in t.items()}
    return {
        "direction": case.direction, "cache": cache, "row_bytes": case.row_bytes,
        "page_tokens": case.page_tokens, "pages": case.pages, "layers": case.layers,
        "bytes": case.nbytes, "kvmove_us": us["kvmove"],
        "kvmove_unchecked_us": us["kvmove unchecked"], "plain_us": us["plain"],
        "added_us": us["kvmove"] - us["plain"],
        "added_unchecked_us": us["kvmove unchecked"] - us["plain"],
        **({"kvmove_device_us": us["kvmove device"],
            "added_device_us": us["kvmove device"] - us["plain"]}
           if "kvmove device" in us else {}),
    }


def run(args) -> dict:
    device = torch.device(args.device)
    timing = dict(repeat=args.repeat, batch_s=args.batch_ms / 1e3)
    cases = []
    # On a GPU the call table uses the tuner's (stacked) workload: a per-layer cache differs
    # only in its address table, made once. The hot path below measures both.
    caches = ["stacked"] if device.type == "cuda" else args.caches
    for cache, page_tokens in ((c, pt) for c in caches for pt in args.page_tokens):
        w = None if device.type == "cuda" else Workload(
            args.row_bytes, page_tokens, max(args.pages), args.layers, device, cache=cache)
        try:
            for pages in args.pages:
                for direction in ("gather", "scatter"):
                    case = Case(direction, args.row_bytes, page_tokens, pages, args.layers)
                    if w is None:
                        calls, plain, close = _gpu_case(case, device)
                    else:
                        (calls, plain), close = _cpu_case(case, w), None
                    try:
                        cases.append(_record(case, cache, per_call({**calls, "plain": plain},
                                                                   device, **timing)))
                    finally:
                        if close is not None:
                            close()
        finally:
            if w is not None:
                w.close()
    tags = ("", "_unchecked", "_device") if device.type == "cuda" else ("", "_unchecked")
    added = {f"{d}{tag}": statistics.median(c[f"added{tag}_us"] for c in cases
                                            if c["direction"] == d)
             for d in ("gather", "scatter") for tag in tags}
    return {
        "device": str(device), "layers": args.layers, "row_bytes": args.row_bytes,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        "plain": "one launch of the kernel, arguments prepared" if device.type == "cuda"
        else "the torch primitive calls of the torch backend, made plainly",
        "calls": cases, "median_added_us": added,
        "hot_path": bench_hot_path.run(args.repeat, device, tuple(args.caches)),
    }


def report(result: dict, console: Console) -> None:
    table = Table(title=f"one call, back to back ({result['device']}, {result['layers']} layers,"
                        f" {result['row_bytes']}-byte rows): kvmove vs {result['plain']}")
    keys = ["kvmove_us", "kvmove_unchecked_us", "plain_us", "added_us", "added_unchecked_us"]
    heads = ["kvmove µs", "unchecked µs", "plain µs", "added µs", "added unchecked µs"]
    if result["calls"] and "kvmove_device_us" in result["calls"][0]:  # a GPU run
        keys += ["kvmove_device_us", "added_device_us"]
        heads += ["device indices µs", "added device µs"]
    for col in ("direction", "cache", "page tokens", "pages", *heads):
        table.add_column(col, justify="right")
    for c in result["calls"]:
        table.add_row(c["direction"], c.get("cache", "stacked"), str(c["page_tokens"]),
                      str(c["pages"]), *(f"{c[k]:.1f}" for k in keys))
    console.print(table)
    for what, us in result["median_added_us"].items():
        console.print(f"{what.replace('_', ' ')}: kvmove adds {us:.1f} µs per call (median)")
    bench_hot_path.report(result["hot_path"], console)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeat, args.batch_ms = min(args.repeat, 5), min(args.batch_ms, 10.0)
    result = {"command": shlex.join(["python", "-m", "bench.bench_calls",
                                     *(sys.argv[1:] if argv is None else argv)]), **run(args)}
    return results.finish_suite(result, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
