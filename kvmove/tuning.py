"""Per-GPU autotuning of the row-copy kernel, and the per-user cache of its results.

``kvmove tune`` (:func:`tune_main`) sweeps the Triton launch configs (bytes per access step,
warps, rows per program step, programs cap) per ``(direction, row-size class, page-tokens
class)`` with ``triton.testing.do_bench``, then measures the direct path (the kernel writes
host memory) against the two-hop path (:mod:`kvmove.two_hop`) for that shape, and stores
both winners in ``$XDG_CACHE_HOME/kvmove/tuned/<gpu-slug>-triton<version>.json``.

At run time the first CUDA launch on a GPU registers that file in front of the tables
shipped in ``kvmove/kernels/tuned/`` (:func:`prepare`), so the lookup order is: user cache,
shipped table, defaults. With ``KVMOVE_AUTOTUNE=1`` a shape missing from the user cache is
tuned on its first use (a second or two, once per shape class; off by default). The file
has the shipped tables' format: copy it to ``kernels/tuned/<gpu-slug>.json`` to ship it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmove.kernels import configs
from kvmove.kernels.configs import LaunchConfig, TunedTable

log = logging.getLogger(__name__)

ENV_AUTOTUNE = "KVMOVE_AUTOTUNE"
DIRECTIONS = ("gather", "scatter")
# One representative shape per class (configs.row_class / configs.tokens_class).
CLASS_ROW_BYTES = {"tiny": 132, "small": 656, "medium": 1152, "large": 8192}
CLASS_PAGE_TOKENS = {"p1": 1, "p16": 16, "p64": 64}
# The search space; caps above the user's limit are never tried.
BLOCK_BYTES = (128, 256, 512, 1024, 2048, 4096, 8192)
ROWS = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8, 16)
PROGRAM_CAPS = (4, 8, 16, 32, 64, 132)
# --quick: fewer values (each new combination is a Triton compile, about a second).
QUICK_AXES = {"rows": (2, 4, 8, 16, 32), "num_warps": (2, 4, 8)}
MAX_TILE_BYTES = 64 << 10  # rows * block bytes held by one program step


def autotune_enabled() -> bool:
    return os.environ.get(ENV_AUTOTUNE, "").strip().lower() in ("1", "true", "yes", "on")


def triton_version() -> str:
    import triton

    return triton.__version__


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvmove" / "tuned"


def cache_path(gpu_name: str, version: str | None = None) -> Path:
    """The user cache file of a GPU and a Triton version."""
    version = triton_version() if version is None else version
    return cache_dir() / f"{configs.gpu_slug(gpu_name)}-triton{version}.json"


def read_cache(path: Path) -> dict:
    """The JSON of a tuning file; ``{}`` when it is missing or unreadable (with a warning)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable tuning cache %s: %s", path, e)
        return {}
    if not isinstance(data, dict):
        log.warning("ignoring the tuning cache %s: not a JSON object", path)
        return {}
    return data


@dataclass
class KeyResult:
    """The outcome of tuning one key."""

    key: str
    direction: str
    row_bytes: int
    page_tokens: int
    layers: int
    nbytes: int
    config: LaunchConfig
    config_gbps: float
    default_gbps: float
    evaluated: int
    direct_gbps: float | None = None
    two_hop_gbps: float | None = None

    @property
    def path(self) -> str | None:
        if self.direct_gbps is None or self.two_hop_gbps is None:
            return None
        return "two_hop" if self.two_hop_gbps > self.direct_gbps else "direct"

    def measurement(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("key", "config"):
            out.pop(name)
        out["path"] = self.path
        return out


def write_results(path: Path, gpu_name: str, results: list[KeyResult]) -> dict:
    """Merge ``results`` into the tuning file at ``path`` (written atomically); returns the
    file's new JSON."""
    data = read_cache(path)
    data.update({
        "gpu": gpu_name,
        "slug": configs.gpu_slug(gpu_name),
        "triton": triton_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    for section in ("configs", "paths", "measurements"):
        data.setdefault(section, {})
    for r in results:
        data["configs"][r.key] = r.config.to_dict()
        data["measurements"][r.key] = r.measurement()
        if r.path is not None:
            data["paths"][r.key] = r.path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return data


# -- run-time lookup ----------------------------------------------------------------------
_user_tables: dict[str, TunedTable] = {}  # gpu slug -> the registered user-cache table
_lock = threading.RLock()
_busy = threading.local()  # set while this thread tunes (no recursion from its launches)
_gpu_names: dict[int, str] = {}


def user_table(gpu_name: str) -> TunedTable:
    """The user cache of ``gpu_name``, registered with the kernel configs on first call."""
    slug = configs.gpu_slug(gpu_name)
    table = _user_tables.get(slug)
    if table is None:
        with _lock:
            table = _user_tables.get(slug)
            if table is None:
                path = cache_path(gpu_name)
                try:
                    table = configs.tuned_table_from_json(read_cache(path))
                except (TypeError, ValueError, AttributeError) as e:
                    log.warning("ignoring the malformed tuning cache %s: %s", path, e)
                    table = TunedTable()
                configs.register_table(table, gpu_name)
                _user_tables[slug] = table
                if table.configs:
                    log.info("using %d tuned configs from %s", len(table.configs), path)
    return table


def prepare(gpu_name: str, device: torch.device, direction: str, row_bytes: int,
            page_tokens: int) -> None:
    """Called before each CUDA launch: registers the user cache (once per GPU) and, with
    ``KVMOVE_AUTOTUNE=1``, tunes this shape's key if the user cache lacks it. Tuning
    failures are logged, never raised: the copy goes on with the config found."""
    table = user_table(gpu_name)
    if not autotune_enabled() or getattr(_busy, "active", False):
        return
    key = configs.config_key(direction, row_bytes, page_tokens)
    if key in table.configs:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    with _lock:
        if key in table.configs:
            return
        log.warning("KVMOVE_AUTOTUNE: tuning %s on %s (once; cached in %s)", key, gpu_name,
                    cache_path(gpu_name))
        try:
            result = tune_key(device, direction, row_bytes, page_tokens, quick=True)
            write_results(cache_path(gpu_name), gpu_name, [result])
        except Exception as e:  # a failed tuning must never break the copy
            log.warning("autotuning %s failed: %s", key, e)
            table.configs[key] = configs.pick(direction, row_bytes, page_tokens, gpu_name)
            return
        apply(table, [result])


def apply(table: TunedTable, results: list[KeyResult]) -> None:
    """Put tuning results into a registered table (in place: lookups see them at once)."""
    for r in results:
        table.configs[r.key] = r.config
        if r.path is not None:
            table.paths[r.key] = r.path


def device_gpu_name(device: torch.device) -> str:
    """The name of the CUDA GPU ``device`` (its index, or the current one), asked of the
    driver once per device: copies look it up on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _gpu_names.get(index)
    if name is None:
        name = _gpu_names.setdefault(index, torch.cuda.get_device_name(index))
    return name


def preferred_backend(device: torch.device, direction: str, row_bytes: int,
                      page_tokens: int) -> str:
    """``"two_hop"`` where the tuner recorded that path as faster for this shape on this GPU
    (user cache, then shipped table), else ``"triton"`` (the direct kernel)."""
    gpu_name = device_gpu_name(device)
    user_table(gpu_name)
    path = configs.pick_path(direction, row_bytes, page_tokens, gpu_name)
    return "two_hop" if path == "two_hop" else "triton"


def reset() -> None:
    """Forget the registered user caches and shipped tables read so far (tests)."""
    with _lock:
        _user_tables.clear()
        _gpu_names.clear()
        configs.clear_registered()
        configs.clear_shipped_cache()


# -- the search ---------------------------------------------------------------------------
def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def valid(config: LaunchConfig, row_bytes: int, max_programs: int) -> bool:
    """Whether a config is worth timing for rows of ``row_bytes``: no block wider than the
    row (the kernel clamps it: a duplicate), no cap above ``max_programs``, a tile that fits
    in registers."""
    block = min(config.block_bytes, max(_pow2_at_least(row_bytes), BLOCK_BYTES[0]))
    return (
        config.block_bytes == block
        and config.max_programs <= max_programs
        and config.rows * config.block_bytes <= MAX_TILE_BYTES
    )


def start_config(row_bytes: int, max_programs: int) -> LaunchConfig:
    """The default config of the row class, made valid for ``row_bytes`` and the cap."""
    c = configs.default_config(row_bytes)
    block = min(c.block_bytes, max(_pow2_at_least(row_bytes), BLOCK_BYTES[0]))
    return dataclasses.replace(c, block_bytes=block,
                               max_programs=min(c.max_programs, max_programs))


def search(measure: Callable[[LaunchConfig], float], row_bytes: int, *, max_programs: int,
           passes: int = 2, quick: bool = False) -> tuple[LaunchConfig, dict[LaunchConfig, float]]:
    """Coordinate descent over the launch parameters: starting at the class default, try
    every value of one parameter with the others fixed, keep the fastest, go on to the next
    parameter; ``passes`` rounds (fewer values with ``quick``). ``measure(config)`` returns
    seconds. Returns the best config and every timing taken."""
    axes = {"block_bytes": BLOCK_BYTES, "rows": ROWS, "num_warps": WARPS,
            "max_programs": PROGRAM_CAPS}
    if quick:
        axes.update(QUICK_AXES)
    seen: dict[LaunchConfig, float] = {}

    def time_of(config: LaunchConfig) -> float:
        if config not in seen:
            seen[config] = measure(config)
        return seen[config]

    best = start_config(row_bytes, max_programs)
    time_of(best)
    for _ in range(passes):
        before = best
        for name, values in axes.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                if valid(candidate, row_bytes, max_programs) and (
                        time_of(candidate) < time_of(best)):
                    best = candidate
        if best == before:
            break
    return best, seen


# -- measuring on a GPU -------------------------------------------------------------------
class Workload:
    """Scratch KV rows on the device and pinned staging for one shape: a random permutation
    of whole KV pages to contiguous staging slots, ``nbytes`` moved per copy."""

    def __init__(self, device: torch.device, row_bytes: int, page_tokens: int, *,
                 layers: int, target_bytes: int, seed: int = 0):
        from kvmove.cache import KVCache
        from kvmove.staging import StagingBuffer

        pages = max(1, target_bytes // (layers * page_tokens * row_bytes))
        rows = pages * page_tokens
        g = torch.Generator(device=device).manual_seed(seed)
        data = torch.randint(0, 256, (layers, rows, row_bytes), dtype=torch.uint8,
                             device=device, generator=g)
        self.kv = KVCache({"kv": data})
        self.staging = StagingBuffer(self.kv, num_slots=pages, page_tokens=page_tokens)
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        self.token_pages = perm[:, None] * page_tokens + torch.arange(page_tokens)[None, :]
        self.slots = torch.arange(pages)
        self.layers, self.page_tokens, self.row_bytes = layers, page_tokens, row_bytes
        self.nbytes = layers * rows * row_bytes
        self.device = device
        staging_rows = self.slots[:, None] * page_tokens + torch.arange(page_tokens)[None, :]
        kv_rows = self.token_pages.reshape(-1).to(device)
        staging_rows = staging_rows.reshape(-1).to(device)
        self._rows = {"gather": (kv_rows, staging_rows), "scatter": (staging_rows, kv_rows)}

    def launcher(self, direction: str) -> Callable[[LaunchConfig], None]:
        """A function that runs the kernel for this shape with a given config."""
        from kvmove.kernels.copy_rows import copy_rows as launch

        src, dst = ((self.kv.row_pool, self.staging.row_pool) if direction == "gather"
                    else (self.staging.row_pool, self.kv.row_pool))
        s_buf, d_buf = src.buffers["kv"], dst.buffers["kv"]
        layers = tuple(range(self.layers))
        tables = s_buf.address_table(layers, self.device), d_buf.address_table(layers, self.device)
        s_rows, d_rows = self._rows[direction]
        addresses = [*s_buf.device_addresses, *d_buf.device_addresses]
        alignment = 1
        while alignment < 16 and all(a % (alignment * 2) == 0 for a in addresses):
            alignment *= 2

        def run(config: LaunchConfig) -> None:
            launch(*tables, s_rows, d_rows, None, src_limit=s_buf.num_rows,
                   dst_limit=d_buf.num_rows, src_pitch=s_buf.pitch, dst_pitch=d_buf.pitch,
                   row_bytes=self.row_bytes, base_alignment=alignment, config=config)

        return run

    def copier(self, direction: str, backend: str) -> Callable[[], None]:
        """A function that runs the public gather/scatter with ``backend``."""
        from kvmove.copy import gather, scatter

        if direction == "gather":
            return lambda: gather(self.kv, self.staging, self.token_pages, self.slots,
                                  backend=backend, check=False)
        return lambda: scatter(self.staging, self.slots, self.kv, self.token_pages,
                               backend=backend, check=False)

    def close(self) -> None:
        self.staging.close()


def bench_seconds(fn: Callable[[], None], *, quick: bool) -> float:
    """Median seconds of ``fn`` by ``triton.testing.do_bench`` (CUDA events)."""
    from triton.testing import do_bench

    warmup, rep = (5, 20) if quick else (10, 50)
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3


def tune_key(device: torch.device, direction: str, row_bytes: int, page_tokens: int, *,
             quick: bool = False, layers: int = 8, target_bytes: int | None = None,
             max_programs: int = configs.DEFAULT_MAX_PROGRAMS,
             compare_paths: bool = True) -> KeyResult:
    """Tune the launch config of one key on ``device`` and, with ``compare_paths``, time the
    direct path (with that config) against the two-hop path."""
    target = target_bytes or ((32 if quick else 96) << 20)
    key = configs.config_key(direction, row_bytes, page_tokens)
    work = Workload(device, row_bytes, page_tokens, layers=layers, target_bytes=target)
    _busy.active = True
    try:
        run = work.launcher(direction)
        best, seen = search(lambda c: bench_seconds(lambda: run(c), quick=quick), row_bytes,
                            max_programs=max_programs, passes=1 if quick else 2, quick=quick)
        start = start_config(row_bytes, max_programs)
        result = KeyResult(
            key=key, direction=direction, row_bytes=row_bytes, page_tokens=page_tokens,
            layers=layers, nbytes=work.nbytes, config=best,
            config_gbps=work.nbytes / seen[best] / 1e9,
            default_gbps=work.nbytes / seen[start] / 1e9, evaluated=len(seen),
        )
        if compare_paths:
            gpu_name = torch.cuda.get_device_name(device)
            trial = TunedTable(configs={key: best})
            configs.register_table(trial, gpu_name)
            try:
                direct = bench_seconds(work.copier(direction, "triton"), quick=quick)
                two_hop = bench_seconds(work.copier(direction, "two_hop"), quick=quick)
            finally:
                configs.unregister_table(trial)
            result.direct_gbps = work.nbytes / direct / 1e9
            result.two_hop_gbps = work.nbytes / two_hop / 1e9
        return result
    finally:
        _busy.active = False
        work.close()


# -- the command --------------------------------------------------------------------------
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
                        help="also write the table here (e.g. kernels/tuned/<gpu-slug>.json)")
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(tune_main())
