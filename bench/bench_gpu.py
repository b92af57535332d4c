"""The GPU benchmark that decides whether the GPU path is good enough, side by side in one
run (``scripts/gpu_check.sh`` runs it; on a machine without a GPU it says so and records
``skipped``):

- **vs bulk**: kvmove's gather (device -> pinned host) and scatter (pinned host -> device)
  of 656 B, 132 B and 1152 B rows, with the launch config capped at 16 programs, against
  one bulk copy of the same bytes between the same memories (goals: gather >= 0.9x,
  scatter >= 0.85x);
- **vs one copy per page**: the same against one ``cudaMemcpyAsync`` per page and layer,
  what a naive port does (goal: >= 10x), for 1-, 16- and 64-token pages;
- **beside a matmul**: how much slower a stream of bf16 matrix products runs while kvmove
  gathers on another stream, with 4, 8 and 16 programs (goal: <= 5% at 8) — kernel copies
  that steal SMs are what engine developers fear most;
- **copy engine vs kernel**: the two-hop path (kernel into a device ring + copy engine)
  against the direct kernel by row size and page count, and the path each tuner key
  should take (``--paths-out`` writes them as a table the user cache reads: ``paths``);
- **page spans**: the kernel launch of a gather/scatter of whole pages (KV rows -> staging
  slots) in page-span mode, in row mode (the kernel before the span mode), and page spans
  without cache hints, against a bulk copy, at 132/656/1152/4100-byte rows, 16/64 tokens.

Every kvmove copy's bytes are checked once before it is timed. Every figure is the median
of interleaved repeats (CUDA events); ratios compare figures of the same run. A refused
copy-engine batch is counted (``refused_batches``): the check fails on any.

    python -m bench.bench_gpu [--quick] [--json out.json] [--paths-out paths.json]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench import results

GOALS = {  # name -> (comparison, target)
    "gather_vs_bulk": (">=", 0.9),
    "scatter_vs_bulk": (">=", 0.85),
    "vs_per_page": (">=", 10.0),
    "matmul_slowdown_at_8": ("<=", 0.05),
}
MAX_PROGRAMS = 16
DIRECT = "triton"  # the backend of kvmove's direct copies (the CPU smoke test uses torch)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--row-bytes", type=int, nargs="+", default=[656, 132, 1152])
    p.add_argument("--page-tokens", type=int, default=64,
                   help="tokens per page of the vs-bulk and matmul cases")
    p.add_argument("--per-page-tokens", type=int, nargs="+", default=[1, 16, 64],
                   help="tokens per page of the vs-one-copy-per-page cases")
    p.add_argument("--target-mib", type=float, default=256, help="MiB moved per copy")
    p.add_argument("--caps", type=int, nargs="+", default=[4, 8, 16],
                   help="programs caps of the gathers beside the matmul")
    p.add_argument("--matmul", type=int, default=8192, help="square bf16 matmul size")
    p.add_argument("--ce-pages", type=int, nargs="+", default=[16, 256, 4096],
                   help="page counts of the copy engine vs kernel cases")
    p.add_argument("--ce-page-tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--span-row-bytes", type=int, nargs="+", default=[132, 656, 1152, 4100],
                   help="row sizes of the page-span vs row-mode cases")
    p.add_argument("--span-page-tokens", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-calls", type=int, default=4000,
                   help="copies per timed run of the one-copy-per-page loop")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="fewer repeats and cases")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--paths-out", type=Path, default=None,
                   help="write the faster path per tuner key here (a tuning table)")
    return p


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Apply ``--quick`` and check the arguments (a clear error, before any GPU work)."""
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 5), min(args.warmup, 1)
        args.target_mib = min(args.target_mib, 128)
        args.ce_pages = [p for p in args.ce_pages if p <= 1024] or args.ce_pages[:1]
    for name in ("layers", "page_tokens", "target_mib", "matmul", "max_calls", "repeats"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    for name in ("row_bytes", "per_page_tokens", "caps", "ce_pages", "ce_page_tokens",
                 "span_row_bytes", "span_page_tokens"):
        if any(v <= 0 for v in getattr(args, name)):
            raise SystemExit(f"--{name.replace('_', '-')} must be positive numbers")
    if 8 not in args.caps:
        raise SystemExit("--caps must include 8 (the goal is stated at 8 programs)")
    return args


# -- measuring (CUDA) ---------------------------------------------------------------------------
@dataclass
class Timed:
    median_s: float
    spread: float

    def gbps(self, nbytes: int) -> float:
        return nbytes / self.median_s / 1e9


def _time(fns: dict[str, Callable[[], None]], device, args) -> dict[str, Timed]:
    from bench.timing import measure

    out = measure(fns, device=device, warmup=args.warmup, repeats=args.repeats)
    return {n: Timed(t.median, round(t.spread, 3)) for n, t in out.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpu_name(device: torch.device) -> str | None:
    """The GPU's name for the config lookup; None off CUDA (the interpreter's config: the
    copy measurements run on the CPU too, as a smoke test of this module)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _pages_for(args, row_bytes: int, page_tokens: int) -> int:
    return max(1, int(args.target_mib * 2**20) // (args.layers * page_tokens * row_bytes))


def _kvmove_copy(w, case):
    """The public gather/scatter on the direct kernel with device-resident indices (the
    mover's hot path), its bytes checked once; the launch config it picks."""
    import kvmove
    from kvmove.rows.launch_config import pick

    token_pages, slots, _ = w.indices(case.pages)
    pages_dev, slots_dev = token_pages.to(w.device), slots.to(w.device)
    if case.direction == "gather":
        def fn():
            kvmove.gather(w.kv, w.staging, pages_dev, slots_dev, backend=DIRECT, check=False)
    else:
        def fn():
            kvmove.scatter(w.staging, slots_dev, w.kv, pages_dev, backend=DIRECT,
                           check=False)
    w.poison(case.direction, case.pages)
    fn()
    _sync(w.device)
    w.check(case.direction, case.pages)
    config = pick(case.direction, case.row_bytes, case.page_tokens, _gpu_name(w.device))
    return fn, config


def _raw_kernel(case, config, device):
    """``(fn, close)``: one launch of the kernel with every argument prepared beforehand,
    the config kvmove picks, on the tuner's workload of this shape (whole KV pages in a
    random order into staging slots 0..n-1, as the measured call copies): the copy
    kvmove's call makes, without the call's host work."""
    from kvmove.tuning.workload import Workload as TuningWorkload

    w = TuningWorkload(device, case.row_bytes, case.page_tokens, layers=case.layers,
                       target_bytes=case.nbytes)
    launch = w.launcher(case.direction)
    return (lambda: launch(config)), w.close


def measure_copies(args, device) -> tuple[list[dict], list[dict]]:
    """The vs-bulk records and the vs-one-copy-per-page records."""
    from bench import baselines
    from bench.cases import Case
    from bench.workload import Workload

    bulk_records, page_records = [], []
    for rb in args.row_bytes:
        for pt in sorted({args.page_tokens, *args.per_page_tokens}):
            pages = _pages_for(args, rb, pt)
            w = Workload(rb, pt, pages, args.layers, device)
            try:
                for direction in ("gather", "scatter"):
                    case = Case(direction, rb, pt, pages, args.layers)
                    fn, config = _kvmove_copy(w, case)
                    fns = {"kvmove": fn}
                    close_kernel = None
                    if pt == args.page_tokens:
                        fns["bulk"] = baselines.bulk(w, case)[0]
                        if device.type == "cuda":  # the same copy without kvmove's host work
                            fns["kernel"], close_kernel = _raw_kernel(case, config, device)
                    per_page = None
                    if pt in args.per_page_tokens:
                        per_page, per_page_bytes = baselines.memcpy_page(w, case,
                                                                         args.max_calls)
                        fns["per_page"] = per_page
                    try:
                        t = _time(fns, device, args)
                    finally:
                        if close_kernel is not None:
                            close_kernel()
                    base = {"direction": direction, "row_bytes": rb, "page_tokens": pt,
                            "pages": pages, "layers": args.layers, "bytes": case.nbytes,
                            "max_programs": config.max_programs,
                            "kvmove_gbps": t["kvmove"].gbps(case.nbytes),
                            "kvmove_spread": t["kvmove"].spread}
                    if "bulk" in t:
                        bulk_records.append({**base, "bulk_gbps": t["bulk"].gbps(case.nbytes),
                                             "bulk_spread": t["bulk"].spread,
                                             **({"kernel_gbps": t["kernel"].gbps(case.nbytes)}
                                                if "kernel" in t else {})})
                    if per_page is not None:
                        page_records.append({**base, "per_page_calls": per_page_bytes
                                             // (pt * rb),
                                             "per_page_gbps": t["per_page"].gbps(per_page_bytes),
                                             "per_page_spread": t["per_page"].spread})
            finally:
                w.close()
                del w
                torch.cuda.empty_cache()
    for r in bulk_records:
        r["ratio"] = r["kvmove_gbps"] / r["bulk_gbps"]
    for r in page_records:
        r["ratio"] = r["kvmove_gbps"] / r["per_page_gbps"]
    return bulk_records, page_records


def measure_interference(args, device) -> dict:
    """Matmuls on one stream, alone and beside back-to-back gathers (656-byte rows, or the
    first row size) on another, per programs cap. The slowdown is the matmuls' median time
    beside the gathers over their median time alone, minus one."""
    from kvmove.kernels.configs import LaunchConfig, default_config
    from kvmove.tuning.workload import Workload as TuningWorkload

    rb = 656 if 656 in args.row_bytes else args.row_bytes[0]
    n = args.matmul
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    w = TuningWorkload(device, rb, args.page_tokens, layers=args.layers,
                       target_bytes=int(min(args.target_mib, 64) * 2**20))
    launch = w.launcher("gather")
    base = default_config(rb)
    mm_stream, copy_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def elapsed(stream, fn, count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(count):
                fn()
            end.record()
        return start, end

    try:
        torch.matmul(a, b, out=out)  # warm
        torch.cuda.synchronize(device)
        s, e = elapsed(mm_stream, lambda: torch.matmul(a, b, out=out), 5)
        e.synchronize()
        per_mm = s.elapsed_time(e) / 5 / 1e3
        mm_count = max(5, int(0.03 / per_mm))  # about 30 ms of matmuls per sample
        result = {"row_bytes": rb, "page_tokens": args.page_tokens, "layers": args.layers,
                  "gather_bytes": w.nbytes, "matmul": n, "matmuls_per_sample": mm_count,
                  "caps": {}}
        alone: list[float] = []
        beside: dict[int, list[float]] = {c: [] for c in args.caps}
        copy_gbps: dict[int, list[float]] = {c: [] for c in args.caps}
        configs = {c: LaunchConfig(base.block_bytes, base.rows, base.num_warps, c)
                   for c in args.caps}
        per_copy = {}
        for c, config in configs.items():  # compile, and size the gather loop per cap
            launch(config)
            torch.cuda.synchronize(device)
            s, e = elapsed(copy_stream, lambda config=config: launch(config), 3)
            e.synchronize()
            per_copy[c] = s.elapsed_time(e) / 3 / 1e3
        for r in range(args.warmup + args.repeats):
            torch.cuda.synchronize(device)
            s, e = elapsed(mm_stream, lambda: torch.matmul(a, b, out=out), mm_count)
            e.synchronize()
            if r >= args.warmup:
                alone.append(s.elapsed_time(e) / 1e3)
            for c, config in configs.items():
                torch.cuda.synchronize(device)
                copies = int(1.5 * mm_count * per_mm / per_copy[c]) + 2  # outlasts the matmuls
                cs, ce = elapsed(copy_stream, lambda config=config: launch(config), copies)
                s, e = elapsed(mm_stream, lambda: torch.matmul(a, b, out=out), mm_count)
                ce.synchronize()
                e.synchronize()
                if r >= args.warmup:
                    beside[c].append(s.elapsed_time(e) / 1e3)
                    copy_gbps[c].append(copies * w.nbytes / (cs.elapsed_time(ce) / 1e3) / 1e9)
        result["matmul_alone_s"] = statistics.median(alone)
        result["matmul_tflops"] = 2 * n**3 * mm_count / result["matmul_alone_s"] / 1e12
        for c in args.caps:
            result["caps"][str(c)] = {
                "matmul_beside_s": statistics.median(beside[c]),
                "slowdown": statistics.median(beside[c]) / result["matmul_alone_s"] - 1,
                "gather_gbps_beside": statistics.median(copy_gbps[c]),
            }
        return result
    finally:
        w.close()


def measure_copy_engine(args, device) -> list[dict]:
    """Direct kernel against the two-hop path, gather and scatter, by row size, page size
    and page count (whole pages in a random order into contiguous slots, as the tuner
    measures; at most ``--target-mib`` per copy); each path's bytes checked once against
    the torch backend's."""
    from kvmove.tuning.workload import Workload as TuningWorkload

    records = []
    cap = int(args.target_mib * 2**20)
    for rb in args.row_bytes:
        for pt in args.ce_page_tokens:
            done = set()
            for wanted in args.ce_pages:
                pages = max(1, min(wanted * pt * rb * args.layers, cap)
                            // (pt * rb * args.layers))
                if pages in done:
                    continue
                done.add(pages)
                w = TuningWorkload(device, rb, pt, layers=args.layers,
                                   target_bytes=pages * pt * rb * args.layers)
                try:
                    for direction in ("gather", "scatter"):
                        fns = {path: w.copier(direction, backend)
                               for path, backend in (("direct", DIRECT),
                                                     ("two_hop", "two_hop"))}
                        _same_bytes(w, direction, fns)
                        t = _time(fns, device, args)
                        gbps = {p: t[p].gbps(w.nbytes) for p in fns}
                        records.append({
                            "direction": direction, "row_bytes": rb, "page_tokens": pt,
                            "pages": pages, "layers": args.layers, "bytes": w.nbytes,
                            "direct_gbps": gbps["direct"], "two_hop_gbps": gbps["two_hop"],
                            "faster": max(gbps, key=gbps.get)})
                finally:
                    w.close()
                    del w
                    torch.cuda.empty_cache()
    return records


SPAN_MODES = {"spans": {}, "rows": {"spans": False}, "spans_no_hints": {"cache_hints": False}}


def _page_launches(w, case, config) -> dict[str, Callable[[], None]]:
    """Per :data:`SPAN_MODES` mode, one launch of the kernel as a gather or scatter of
    pages makes it (KV rows and staging slots on the device, everything prepared), each
    mode's bytes checked once."""
    from kvmove.kernels.alignment import pow2_alignment
    from kvmove.kernels.row_copy import copy_rows

    token_pages, slots, _ = w.indices(case.pages)
    kv_rows, slots = token_pages.reshape(-1).to(w.device), slots.to(w.device)
    kv, staging = w.kv.row_pool.buffers["kv"], w.staging.row_pool.buffers["kv"]
    gathering = case.direction == "gather"
    src, dst = (kv, staging) if gathering else (staging, kv)
    src_rows, dst_rows = (kv_rows, slots) if gathering else (slots, kv_rows)
    layers = tuple(range(case.layers))
    tables = src.address_table(layers, w.device), dst.address_table(layers, w.device)
    geometry = dict(src_limit=src.num_rows, dst_limit=dst.num_rows, src_pitch=src.pitch,
                    dst_pitch=dst.pitch, row_bytes=case.row_bytes, config=config,
                    base_alignment=pow2_alignment(*src.device_addresses,
                                                  *dst.device_addresses),
                    src_page_tokens=0 if gathering else case.page_tokens,
                    dst_page_tokens=case.page_tokens if gathering else 0)
    fns = {}
    for mode, options in SPAN_MODES.items():
        def fn(options=options):
            copy_rows(*tables, src_rows, dst_rows, None, **geometry, **options)
        w.poison(case.direction, case.pages)
        fn()
        _sync(w.device)
        w.check(case.direction, case.pages)
        fns[mode] = fn
    return fns


def measure_page_spans(args, device) -> list[dict]:
    """Page-span mode against row mode, page spans without cache hints and a bulk copy of
    the same bytes, interleaved, per direction, row size and page size."""
    from bench import baselines
    from bench.cases import Case
    from bench.workload import Workload
    from kvmove.rows.launch_config import pick

    records = []
    for rb in args.span_row_bytes:
        for pt in args.span_page_tokens:
            pages = _pages_for(args, rb, pt)
            w = Workload(rb, pt, pages, args.layers, device)
            try:
                for direction in ("gather", "scatter"):
                    case = Case(direction, rb, pt, pages, args.layers)
                    config = pick(direction, rb, pt, _gpu_name(device))
                    fns = {**_page_launches(w, case, config),
                           "bulk": baselines.bulk(w, case)[0]}
                    t = _time(fns, device, args)
                    record = {"direction": direction, "row_bytes": rb, "page_tokens": pt,
                              "pages": pages, "layers": args.layers, "bytes": case.nbytes}
                    for name in fns:
                        record[f"{name}_gbps"] = t[name].gbps(case.nbytes)
                        record[f"{name}_spread"] = t[name].spread
                    record["spans_vs_rows"] = record["spans_gbps"] / record["rows_gbps"]
                    record["spans_vs_bulk"] = record["spans_gbps"] / record["bulk_gbps"]
                    records.append(record)
            finally:
                w.close()
                del w
                torch.cuda.empty_cache()
    return records


def _same_bytes(w, direction: str, fns: dict) -> None:
    """Each path writes what the torch backend writes: the staging of a gather (poisoned
    first), the KV rows of a scatter (the staging's pages, written back where they came
    from, after the KV was poisoned)."""
    gathering = direction == "gather"
    target = w.staging.tensor("kv") if gathering else w.kv.row_pool.buffers["kv"].layers[0]
    seen = []
    for fn in (w.copier(direction, "torch"), *fns.values()):
        if gathering:
            target.fill_(0xA5)
        else:
            w.kv.row_pool.buffers["kv"].layers[0][: w.token_pages.numel()].fill_(0xA5)
        fn()
        _sync(w.device)
        seen.append(target.clone())
    for name, got in zip(fns, seen[1:], strict=True):
        if not torch.equal(seen[0], got):
            raise AssertionError(f"{direction}: the {name} path wrote other bytes than the "
                                 "torch backend")


# -- results (pure: tested without a GPU) ---------------------------------------------------------
def tuner_paths(records: list[dict]) -> dict[str, str]:
    """The faster path per tuner key (direction, row class, page class): the one that won
    the most bytes over that key's cases (ties: direct)."""
    from kvmove.kernels.configs import config_key

    won: dict[str, dict[str, int]] = {}
    for r in records:
        key = config_key(r["direction"], r["row_bytes"], r["page_tokens"])
        counts = won.setdefault(key, {"direct": 0, "two_hop": 0})
        counts[r["faster"]] += r["bytes"]
    return {k: ("two_hop" if c["two_hop"] > c["direct"] else "direct")
            for k, c in sorted(won.items())}


@dataclass
class Goal:
    name: str
    text: str
    value: float | None
    op: str
    target: float

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.target if self.op == ">=" else self.value <= self.target


def goals(result: dict) -> list[Goal]:
    """The GPU path's goals, each judged on the worst case it covers (every row size)."""
    out = []
    for direction in ("gather", "scatter"):
        rs = [r for r in result.get("vs_bulk", []) if r["direction"] == direction]
        op, target = GOALS[f"{direction}_vs_bulk"]
        capped = all(r["max_programs"] <= MAX_PROGRAMS for r in rs)
        value = min((r["ratio"] for r in rs), default=None) if capped else None
        out.append(Goal(f"{direction}_vs_bulk", f"{direction} vs a bulk pinned copy (worst row "
                        f"size, <= {MAX_PROGRAMS} programs)" + ("" if capped or not rs else
                                                               ": a config exceeds the cap"),
                        value, op, target))
    op, target = GOALS["vs_per_page"]
    rs = result.get("vs_per_page", [])
    out.append(Goal("vs_per_page", "vs one cudaMemcpyAsync per page (worst case)",
                    min((r["ratio"] for r in rs), default=None), op, target))
    op, target = GOALS["matmul_slowdown_at_8"]
    at8 = result.get("matmul", {}).get("caps", {}).get("8")
    out.append(Goal("matmul_slowdown_at_8", "matmul slowdown while gathering, 8 programs",
                    None if at8 is None else at8["slowdown"], op, target))
    return out


def _fmt_goal(g: Goal) -> str:
    if g.value is None:
        return f"{g.text}: not measured"
    value = f"{g.value:+.1%}" if g.name.startswith("matmul") else f"{g.value:.2f}x"
    shown = f"{g.target:.0%}" if g.name.startswith("matmul") else f"{g.target:g}x"
    return f"{g.text}: {value} (goal {g.op} {shown}: {'met' if g.met else 'MISSED'})"


def markdown(result: dict) -> list[str]:
    """The result as markdown lines (the README section's GPU part)."""
    if "skipped" in result:
        return [f"*GPU benchmark: {result['skipped']}*", ""]
    out = [f"**GPU path** on {result.get('gpu')} (`{result.get('command', '')}`), "
           f"{result['layers']} layers, medians of {result['repeats']} interleaved repeats:", ""]
    out += [f"- {_fmt_goal(g)}" for g in goals(result)]
    out += ["", "| direction | row B | tokens | kvmove GB/s | kernel alone GB/s | bulk GB/s "
            "| ratio | programs |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['direction']} | {r['row_bytes']} | {r['page_tokens']} | "
            f"{r['kvmove_gbps']:.1f} | "
            + (f"{r['kernel_gbps']:.1f}" if "kernel_gbps" in r else "-")
            + f" | {r['bulk_gbps']:.1f} | {r['ratio']:.2f}x | {r['max_programs']} |"
            for r in result.get("vs_bulk", [])]
    out += ["", "| direction | row B | tokens | kvmove GB/s | per-page memcpy GB/s | ratio |",
            "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {r['direction']} | {r['row_bytes']} | {r['page_tokens']} | "
            f"{r['kvmove_gbps']:.1f} | {r['per_page_gbps']:.2f} | {r['ratio']:.1f}x |"
            for r in result.get("vs_per_page", [])]
    mm = result.get("matmul")
    if mm:
        out += ["", f"Matmul {mm['matmul']}^3 bf16 ({mm['matmul_tflops']:.0f} TFLOP/s alone) "
                f"beside gathers of {mm['row_bytes']}-byte rows:", "",
                "| programs | matmul slowdown | gather GB/s over the run |", "|---:|---:|---:|"]
        out += [f"| {c} | {v['slowdown']:+.1%} | {v['gather_gbps_beside']:.1f} |"
                for c, v in mm["caps"].items()]
    ce = result.get("copy_engine", [])
    if ce:
        out += ["", "| direction | row B | tokens | pages | direct GB/s | two-hop GB/s | faster |",
                "|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {r['direction']} | {r['row_bytes']} | {r['page_tokens']} | {r['pages']} | "
                f"{r['direct_gbps']:.1f} | {r['two_hop_gbps']:.1f} | {r['faster']} |"
                for r in ce]
    spans = result.get("page_spans", [])
    if spans:
        out += ["", "Kernel launches of whole pages: page-span mode vs row mode (GB/s, "
                "spread in brackets):", "",
                "| direction | row B | tokens | spans | rows | spans, no hints | bulk "
                "| spans/rows | spans/bulk |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['direction']} | {r['row_bytes']} | {r['page_tokens']} | "
                + " | ".join(f"{r[m + '_gbps']:.1f} ({r[m + '_spread']:.0%})"
                             for m in (*SPAN_MODES, "bulk"))
                + f" | {r['spans_vs_rows']:.2f}x | {r['spans_vs_bulk']:.2f}x |" for r in spans]
    out += ["", f"Refused copy-engine batches: {result.get('refused_batches', 0)}.", ""]
    return out


def report(result: dict, console: Console) -> None:
    if "skipped" in result:
        console.print(f"[yellow]GPU benchmark skipped: {result['skipped']}[/]")
        return
    table = Table(title=f"GPU path on {result.get('gpu')}: goals")
    for col in ("goal", "value", "target", "met"):
        table.add_column(col)
    for g in goals(result):
        value = "-" if g.value is None else (f"{g.value:+.1%}" if g.name.startswith("matmul")
                                             else f"{g.value:.2f}x")
        table.add_row(g.text, value, f"{g.op} {g.target:g}",
                      "-" if g.met is None else ("met" if g.met else "MISSED"))
    console.print(table)
    for line in markdown(result):
        if line.startswith("|"):
            console.print(line, markup=False, highlight=False)


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU (torch sees none)"}
    from kvmove.rows.copy_engine.span_copies import cuda_copier

    refused = cuda_copier().batch_failures
    vs_bulk, vs_page = measure_copies(args, device)
    result = {
        "benchmark": "bench_gpu", "gpu": torch.cuda.get_device_name(device),
        "layers": args.layers, "repeats": args.repeats, "warmup": args.warmup,
        "vs_bulk": vs_bulk, "vs_per_page": vs_page,
        "matmul": measure_interference(args, device),
        "page_spans": measure_page_spans(args, device),
    }
    torch.cuda.empty_cache()
    result |= {
        "copy_engine": measure_copy_engine(args, device),
        "has_memcpy_batch": cuda_copier().has_batch,
    }
    result["tuner_paths"] = tuner_paths(result["copy_engine"])
    result["refused_batches"] = cuda_copier().batch_failures - refused
    result["goals"] = {g.name: {"value": g.value, "target": g.target, "op": g.op,
                                "met": g.met} for g in goals(result)}
    return result


def write_paths(result: dict, path: Path) -> None:
    """The faster paths as a tuning table (``{"configs": {}, "paths": {...}}``), the form
    the user cache and ``kvmove tune --out`` use."""
    from kvmove.kernels.configs import TunedTable

    table = TunedTable(paths=dict(result.get("tuner_paths", {})))
    results.save(table.to_json(), path)


def main(argv=None) -> int:
    args = settle(build_parser().parse_args(argv))
    result = {"command": shlex.join(["python", "-m", "bench.bench_gpu",
                                     *(sys.argv[1:] if argv is None else argv)]), **run(args)}
    if args.paths_out is not None and "tuner_paths" in result:
        write_paths(result, args.paths_out)
    return results.finish_suite(result, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
