"""``kvmove tune``: tune every requested key on this GPU and write the user cache (and,
with ``--out``, a table to ship)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from kvmove.kernels import configs
from kvmove.rows.launch_config import cache_path, triton_version, user_table
from kvmove.tuning.key_tuning import (
    CLASS_PAGE_TOKENS,
    CLASS_ROW_BYTES,
    DIRECTIONS,
    KeyResult,
    apply,
    tune_key,
    write_results,
)

log = logging.getLogger(__name__)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="kvmove tune", description="Autotune kvmove's row-copy kernel for this GPU.")
    parser.add_argument("--direction", nargs="+", choices=DIRECTIONS, default=list(DIRECTIONS),
                        help="copy directions to tune (default: all)")
    parser.add_argument("--row-bytes", nargs="+", type=int,
                        default=list(CLASS_ROW_BYTES.values()),
                        help="row sizes to tune on (one per row-size class by default)")
    parser.add_argument("--page-tokens", nargs="+", type=int,
                        default=list(CLASS_PAGE_TOKENS.values()),
                        help="tokens per page to tune on (one per page class by default)")
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the cache tuned on (default 8)")
    parser.add_argument("--max-programs", type=int, default=configs.DEFAULT_MAX_PROGRAMS,
                        help="largest programs cap to try (the engine needs the other SMs)")
    parser.add_argument("--quick", action="store_true",
                        help="one search pass over fewer values, shorter timings")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="seconds after which no further key is started (0: no limit); "
                             "keys run in the order given")
    parser.add_argument("--no-paths", action="store_true",
                        help="skip the direct against two-hop comparison")
    parser.add_argument("--device", type=int, default=None, help="CUDA device index")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the table here (a copy of the user cache entry)")
    parser.add_argument("--no-cache", action="store_true", help="leave the user cache alone")
    return parser


def _print_results(gpu_name: str, results: list[KeyResult], where: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvmove tune: {gpu_name}, Triton {triton_version()}")
    for col in ("key", "row B", "tokens", "block B", "rows", "warps", "cap", "GB/s",
                "x default", "direct GB/s", "two-hop GB/s", "path"):
        table.add_column(col, justify="left" if col in ("key", "path") else "right")
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for r in results:
        c = r.config
        table.add_row(r.key, str(r.row_bytes), str(r.page_tokens), str(c.block_bytes),
                      str(c.rows), str(c.num_warps), str(c.max_programs), f"{r.config_gbps:.1f}",
                      f"{r.config_gbps / r.default_gbps:.2f}", fmt(r.direct_gbps),
                      fmt(r.two_hop_gbps), r.path or "-")
    console = Console()
    console.print(table)
    for path in where:
        console.print(f"written: {path}")


def tune_main(argv=None) -> int:
    """``kvmove tune``: tune every requested key on this GPU; 0 on success, and 0 with a
    message when there is no GPU."""
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("kvmove tune: no CUDA GPU here, nothing to tune (without a GPU kvmove copies "
              "with the torch backend, and the Triton interpreter uses one fixed config).")
        return 0
    device = torch.device("cuda", torch.cuda.current_device() if args.device is None
                          else args.device)
    gpu_name = torch.cuda.get_device_name(device)
    shapes: dict[str, tuple[str, int, int]] = {}
    for rb in args.row_bytes:  # the order given: the most wanted shapes first
        for pt in args.page_tokens:
            for direction in args.direction:
                shapes.setdefault(configs.config_key(direction, rb, pt), (direction, rb, pt))
    results = []
    started = time.monotonic()
    for i, (key, (direction, rb, pt)) in enumerate(shapes.items(), 1):
        if args.time_limit and time.monotonic() - started > args.time_limit:
            print(f"time limit of {args.time_limit:.0f} s reached: not tuned: "
                  f"{', '.join(list(shapes)[i - 1:])}", flush=True)
            break
        log.info("[%d/%d] tuning %s (%d-byte rows, %d-token pages)", i, len(shapes), key, rb, pt)
        r = tune_key(device, direction, rb, pt, quick=args.quick, layers=args.layers,
                     max_programs=args.max_programs, compare_paths=not args.no_paths)
        print(f"[{i}/{len(shapes)}] {key}: {r.config} {r.config_gbps:.1f} GB/s "
              f"(default {r.default_gbps:.1f}); path {r.path}", flush=True)
        results.append(r)
    written = []
    if not args.no_cache:
        path = cache_path(gpu_name)
        write_results(path, gpu_name, results)
        apply(user_table(gpu_name), results)
        written.append(path)
    if args.out is not None:
        write_results(args.out, gpu_name, results)
        written.append(args.out)
    _print_results(gpu_name, results, written)
    return 0
