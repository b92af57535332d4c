"""Every benchmark, one command: ``python -m bench.run_all [--quick] [--out DIR]`` (``make
bench``). Writes ``<out>/<machine>-<date>[-quick].json`` and a PNG beside it, prints the
tables, and the README's performance section comes from the JSON (``python -m
bench.report``).

The kernel benchmark is :mod:`bench.kernels`. Other suites plug in as modules of this
package, run as ``python -m <module> ... --json PATH`` in a process of their own (their
results, included under ``suites``): ``bench/bench_store.py`` (descriptors, store put/get) and
``bench/bench_mover.py`` (mover evict/prefetch end to end), ``bench/bench_in_place.py``
(``KVMover`` on a host-memory cache against the store reading and writing the KV rows in
place), ``bench/bench_calls.py`` (the fixed cost of one call, back to back),
``bench/bench_gpu.py`` (the GPU path's goals: vs bulk and per-page copies, beside a matmul,
copy engine vs kernel; skipped without a GPU), ``bench/bench_vllm.py`` (vLLM connector
save/load against vLLM's own Mooncake connector, in ``.venv-vllm``) and
``bench/bench_direct.py`` (prefill -> decode host pool: PageSender against evict + get
through the store), ``bench/bench_checksum.py`` (evict + prefetch with the end-to-end
checksum against without). A suite whose module is missing is skipped with a message.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from bench import machine, results
from bench.cases import CACHES, DIRECTIONS, Settings
from bench.kernels import run_kernels
from bench.table import print_all

log = logging.getLogger("bench")

# name -> (module, argv for --quick, argv for a full run); each gets --json PATH appended.
SUITES = {
    "store": ("bench.bench_store",
              ["--keys", "1024", "--repeat", "5", "--store-keys", "32", "--store-repeat", "3"],
              []),
    "mover": ("bench.bench_mover", ["--quick"], []),
    "in_place": ("bench.bench_in_place", ["--quick"], []),
    "calls": ("bench.bench_calls", ["--quick"], []),
    "gpu": ("bench.bench_gpu", ["--quick"], []),  # records "skipped" without a GPU
    "vllm": ("bench.bench_vllm", ["--quick"], []),
    "sglang": ("bench.bench_sglang", ["--quick"], []),
    "direct": ("bench.bench_direct", ["--quick"], []),
    "checksum": ("bench.bench_checksum", ["--quick"], []),
    "metrics_cost": ("bench.bench_metrics_cost", ["--quick"], []),
}
# Suites that run in another environment: name -> its Python (skipped when absent).
_ROOT = Path(__file__).resolve().parents[1]
SUITE_PYTHON = {"vllm": _ROOT / ".venv-vllm" / "bin" / "python",
                "sglang": _ROOT / ".venv-sglang" / "bin" / "python"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run_all",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (about 2 minutes on a CPU)")
    p.add_argument("--out", type=Path, default=results.RESULTS_DIR, help="results folder")
    p.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda if present)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--row-bytes", type=int, nargs="+", default=None)
    p.add_argument("--page-tokens", type=int, nargs="+", default=None)
    p.add_argument("--pages", type=int, nargs="+", default=None)
    p.add_argument("--direction", nargs="+", choices=DIRECTIONS, default=None)
    p.add_argument("--caches", nargs="+", choices=CACHES, default=None,
                   help="how the KV cache is given: one stacked tensor, per-layer tensors")
    p.add_argument("--methods", nargs="+", default=None,
                   help="kvmove methods and baselines to time (default: all that apply)")
    p.add_argument("--max-mib", type=int, default=None, help="byte cap per side of a case")
    p.add_argument("--min-sample-ms", type=float, default=None,
                   help="a sample of a shorter call is several calls back to back, about "
                        "this long (CPU default: 20 ms, 5 with --quick; 0: one call)")
    p.add_argument("--max-calls", type=int, default=None,
                   help="copies per timed run of the per-page/per-row memcpy loops")
    p.add_argument("--only", nargs="+", choices=["kernels", *SUITES], default=None,
                   help="run only these suites")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", action="store_true",
                   help="write docs/PERFORMANCE.md and the README's headline figures from "
                        "this run (python -m bench.report)")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    s = Settings.defaults(device, quick=args.quick)
    for field, value in (("layers", args.layers), ("repeats", args.repeats),
                         ("warmup", args.warmup), ("max_calls", args.max_calls)):
        if value is not None:
            setattr(s, field, value)
    for field, value in (("row_bytes", args.row_bytes), ("page_tokens", args.page_tokens),
                         ("pages", args.pages), ("directions", args.direction),
                         ("caches", args.caches), ("methods", args.methods)):
        if value is not None:
            setattr(s, field, tuple(value))
    if args.max_mib is not None:
        s.max_bytes = args.max_mib << 20
    if args.min_sample_ms is not None:
        s.min_sample_s = args.min_sample_ms / 1e3
    return s


def run_suite(name: str, quick: bool, console: Console) -> dict:
    """Run an optional suite (``python -m <module> ... --json PATH``) in a process of its
    own, so that what one suite leaves behind (Mooncake's threads, allocator state) cannot
    bend another's figures; its JSON, or why it was skipped or failed."""
    module_name, quick_argv, full_argv = SUITES[name]
    if importlib.util.find_spec(module_name) is None:
        message = f"{module_name.replace('.', '/')}.py is not there yet"
        console.print(f"[yellow]skipped the {name} suite: {message}[/]")
        return {"skipped": message}
    python = SUITE_PYTHON.get(name, Path(sys.executable))
    if not python.exists():
        message = f"{python} is missing (bash scripts/test_vllm.sh --setup-only sets it up)"
        console.print(f"[yellow]skipped the {name} suite: {message}[/]")
        return {"skipped": message}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.json"
        argv = [*(quick_argv if quick else full_argv), "--json", str(path)]
        console.rule(f"{name} suite: python -m {module_name} {shlex.join(argv[:-2])}")
        t0 = time.perf_counter()
        code = subprocess.run([str(python), "-m", module_name, *argv]).returncode
        if code != 0:
            log.error("the %s suite failed (exit code %s)", name, code)
            return {"failed": f"exit code {code}"}
        out = json.loads(path.read_text()) if path.exists() else {}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(width=None if sys.stdout.isatty() else 200)
    settings = settings_from(args)
    if settings.device.type == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda asked for, but torch sees no CUDA GPU[/]")
        return 2
    who = machine.describe(settings.device)
    command = shlex.join(["python", "-m", "bench.run_all", *(argv if argv is not None
                                                             else sys.argv[1:])])
    data = results.new(who, settings.to_json(), command)
    path = results.results_path(args.out, who["name"], quick=args.quick)
    suites = args.only or ["kernels", *SUITES]
    t0 = time.perf_counter()
    if "kernels" in suites:
        console.rule(f"kernels on {who['title']}: {settings.layers} layers, "
                     f"{settings.repeats} repeats")
        def keep(record: dict) -> None:  # saved as they come: a cut-short run keeps them
            data["kernels"].append(record)
            results.save(data, path)

        run_kernels(settings, progress=console.print, on_record=keep)
    for name in SUITES:
        if name in suites:
            data["suites"][name] = run_suite(name, args.quick, console)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    results.save(data, path)
    console.rule("results")
    print_all(data, console)
    if data["kernels"] and not args.no_plot:
        from bench.plot import plot

        console.print(f"plot:    {plot(data, path.with_suffix('.png'))}")
    console.print(f"results: {path}")
    if args.report:
        from bench import report

        report.main([str(path), "--out", "docs/PERFORMANCE.md", "--readme", "README.md"])
        console.print("wrote docs/PERFORMANCE.md and the README's headline figures")
    else:
        console.print(f"(docs/PERFORMANCE.md: python -m bench.report {path} --out "
                      f"docs/PERFORMANCE.md --readme README.md)")
    console.print(f"took {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
