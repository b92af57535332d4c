"""The hot path of an engine's decode step, as ratios measured in one run, on a KV cache
given as one stacked tensor and as per-layer tensors (SGLang's device pools: one allocation
per layer):

- gathers and scatters of one page and of 32 pages, of 1- and 16-token pages (paged and
  scattered token slots), through the public API against the plain per-layer torch ops
  that move the same rows (``index_select`` / ``index_copy_``); target at most 1.3x, the
  worst case reported and every case that misses listed with the run's spread;
- the time ``KVMover.prefetch`` takes to *return* (it only schedules work) for 32 keys of
  one-token pages x 61 layers; target within 60 µs; and how long the caller then waits
  for the GIL while a worker runs the get (a figure, no target);
- a layer-wise prefetch of those keys against a whole-cache prefetch of the same keys, to
  the end; target at most 1.15x;
- on a CPU, a gather of 656-byte rows while every core is kept busy by other processes,
  against a Python loop of one ``memmove`` per row under the same load; target at least 3x.

Every figure is a median of interleaved repeats; targets are goals, never test assertions.
Part of ``python -m bench.bench_calls``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results
from kvmove.errors import StoreError
from kvmove.store.embedded_master import find_master_binary

CPU = torch.device("cpu")
CACHES = ("stacked", "per_layer")
TARGETS = {"one_page_gather": 1.3, "one_page_scatter": 1.3, "prefetch_return_us": 60.0,
           "layerwise_over_whole": 1.15, "busy_gather_over_memmove_loop": 3.0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_us(fns: dict[str, Callable[[], object]], *, repeat: int, calls: int,
              device: torch.device = CPU) -> dict:
    """Median µs per call of each function: ``calls`` back-to-back calls per sample (and the
    device drained), the functions interleaved sample by sample."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def kv_cache(cache: str, layers: int, slots: int, row_bytes: int,
             device: torch.device) -> kvmove.KVCache:
    """A cache of random bytes: one stacked ``[layers, slots, row_bytes]`` tensor, or
    ``layers`` tensors allocated one by one."""
    if cache == "stacked":
        return kvmove.KVCache({"kv": torch.randint(0, 256, (layers, slots, row_bytes),
                                                   dtype=torch.uint8, device=device)})
    if cache == "per_layer":
        return kvmove.KVCache({"kv": [torch.randint(0, 256, (slots, row_bytes),
                                                    dtype=torch.uint8, device=device)
                                      for _ in range(layers)]})
    raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")


# The one-page cases: (pages, page tokens, token slots) -- "paged": each page the aligned run
# of a paged KV cache, "scattered": token slots drawn at random (DSA top-k evictions).
ONE_PAGE_CASES = ((1, 1, "scattered"), (1, 16, "paged"), (1, 16, "scattered"),
                  (32, 1, "scattered"), (32, 16, "paged"), (32, 16, "scattered"))


def _interleaved_us(fns: dict[str, Callable[[], object]], *, repeat: int, calls: int,
                    device: torch.device) -> dict[str, list[float]]:
    """µs per call of each function, one sample per repeat (``calls`` back-to-back calls),
    the functions interleaved sample by sample."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return samples


def one_page_case(kv: kvmove.KVCache, repeat: int, device: torch.device, pages: int,
                  tokens: int, slots_kind: str) -> dict:
    """One gather and scatter of ``pages`` pages of ``tokens`` token slots (``slots_kind``:
    "paged" or "scattered") through the public API against the plain per-layer torch ops
    on the same rows (on a GPU: into the same pinned staging), and through
    :func:`kvmove.prepare_pages` (indices planned once), interleaved."""
    layers, row_bytes = kv.num_layers("kv"), kv.row_bytes("kv")
    staging = kvmove.StagingBuffer(kv, num_slots=64, page_tokens=tokens)
    g = torch.Generator().manual_seed(pages * 100 + tokens)
    if slots_kind == "scattered":
        rows = torch.randperm(kv.num_slots, generator=g)[:pages * tokens]
    else:
        rows = torch.arange(pages * tokens) + 37 * tokens
    token_pages = rows.reshape(pages, tokens).to(device)
    rows = token_pages.reshape(-1)
    first = 5  # staging slots first .. first + pages - 1
    slots = torch.arange(first, first + pages)
    kv_layers = [kv.layer("kv", i) for i in range(layers)]
    staged = [staging.tensor("kv")[i].view(-1, row_bytes)[first * tokens:
                                                           (first + pages) * tokens]
              for i in range(layers)]

    def plain_gather():
        for i in range(layers):
            staged[i].copy_(kv_layers[i].index_select(0, rows), non_blocking=True)

    def plain_scatter():
        for i in range(layers):
            kv_layers[i].index_copy_(0, rows, staged[i].to(device, non_blocking=True))

    if device.type == "cpu":  # straight into the staging rows
        def plain_gather():
            for i in range(layers):
                torch.index_select(kv_layers[i], 0, rows, out=staged[i])

        def plain_scatter():
            for i in range(layers):
                kv_layers[i].index_copy_(0, rows, staged[i])

    prepared = kvmove.prepare_pages(kv, staging, token_pages, slots)  # planned once
    samples = _interleaved_us({
        "gather": lambda: kvmove.gather(kv, staging, token_pages, slots),
        "prepared gather": prepared.gather,
        "plain gather": plain_gather,
        "scatter": lambda: kvmove.scatter(staging, slots, kv, token_pages),
        "prepared scatter": prepared.scatter,
        "plain scatter": plain_scatter,
    }, repeat=repeat, calls=200 if pages * tokens <= 16 else 40, device=device)
    staging.close()
    us = {name: statistics.median(s) for name, s in samples.items()}
    return {"pages": pages, "page_tokens": tokens, "slots": slots_kind, "us": us,
            "spread": {name: _spread(s) for name, s in samples.items()},
            "gather_ratio": us["gather"] / us["plain gather"],
            "scatter_ratio": us["scatter"] / us["plain scatter"],
            "prepared_gather_ratio": us["prepared gather"] / us["plain gather"],
            "prepared_scatter_ratio": us["prepared scatter"] / us["plain scatter"]}


def one_page(repeat: int, device: torch.device = CPU, cache: str = "stacked") -> dict:
    """Gathers and scatters of :data:`ONE_PAGE_CASES` (8 layers of 656-B rows) against the
    plain per-layer torch ops on the same rows. ``one_page_gather`` / ``one_page_scatter``
    are the worst case's ratio; ``missed`` lists every case over its target, with the
    run's spread (of each side's samples: (max - min) / median)."""
    layers, row_bytes = 8, 656
    kv = kv_cache(cache, layers, 4096, row_bytes, device)
    cases = [one_page_case(kv, repeat, device, *case) for case in ONE_PAGE_CASES]
    missed = [f"{op} {c['pages']} x {c['page_tokens']}-token {c['slots']}: "
              f"{c[op + '_ratio']:.2f}x (spread {c['spread'][op]:.0%} / "
              f"{c['spread']['plain ' + op]:.0%})"
              for c in cases for op in ("gather", "scatter")
              if c[op + "_ratio"] > TARGETS["one_page_" + op]]
    return {"device": str(device), "cache": cache, "layers": layers, "row_bytes": row_bytes,
            "cases": cases, "missed": missed,
            "one_page_gather": max(c["gather_ratio"] for c in cases),
            "one_page_scatter": max(c["scatter_ratio"] for c in cases)}


def prefetches(store, repeat: int, device: torch.device = CPU, cache: str = "stacked") -> dict:
    """32 keys of one-token pages x 61 layers: how long ``prefetch`` takes to return, and a
    layer-wise prefetch to the end against a whole-cache one, once the mover has made one
    prefetch of each kind (a fresh mover's first calls are measured apart: docs/PERFORMANCE.md,
    Findings, 2026-12-06)."""
    layers, keys_n, row_bytes = 61, 32, 656
    kv = kv_cache(cache, layers, 1024, row_bytes, device)
    with kvmove.KVMover(kv, store, page_tokens=1, staging_slots=64, key_prefix="hot") as mover:
        keys = [f"hot-{os.getpid()}-{cache}-{i}" for i in range(keys_n)]
        assert mover.evict(keys, torch.arange(keys_n).reshape(-1, 1)).wait(60) == [
            kvmove.Status.OK] * keys_n
        dest = torch.arange(512, 512 + keys_n).reshape(-1, 1)
        for mode in (False, True):  # warmed, as median_us warms every function it times
            assert mover.prefetch(keys, dest, layerwise=mode).wait() == [
                kvmove.Status.OK] * keys_n
        returns, whole, layerwise, gil_busy, gil_idle = [], [], [], [], []
        for _ in range(repeat):
            gil_busy.append(_gil_wait_us(mover, keys, dest, busy=True))
            gil_idle.append(_gil_wait_us(mover, keys, dest, busy=False))
            for mode in ("whole", "layerwise"):
                t0 = time.perf_counter()
                t = mover.prefetch(keys, dest, layerwise=mode == "layerwise")
                returned = time.perf_counter() - t0
                statuses = t.wait()  # as engines wait (unbounded: may run a queued job here)
                t.scattered.synchronize()
                done = time.perf_counter() - t0
                assert statuses == [kvmove.Status.OK] * keys_n, statuses
                returns.append(returned * 1e6)
                (whole if mode == "whole" else layerwise).append(done * 1e6)
        mover.store.remove(mover.keyspace.store_keys(keys), force=True)
    return {"device": str(device), "cache": cache, "layers": layers, "keys": keys_n,
            "row_bytes": row_bytes, "prefetch_return_us": statistics.median(returns),
            "prefetch_return_spread": _spread(returns),
            "whole_us": statistics.median(whole), "layerwise_us": statistics.median(layerwise),
            "layerwise_over_whole": statistics.median(layerwise) / statistics.median(whole),
            # each busy probe against the idle one next to it: drift of the load cancels
            "gil_wait_us": statistics.median(b - i for b, i in zip(gil_busy, gil_idle,
                                                                  strict=True)),
            "gil_release_busy_us": statistics.median(gil_busy),
            "gil_release_idle_us": statistics.median(gil_idle),
            "gil_release_busy_spread": _spread(gil_busy)}


def _gil_wait_us(mover, keys, dest, *, busy: bool) -> float:
    """µs of one call that gives the GIL up and takes it back (``time.sleep(0)``, as any
    torch op does) on the caller's thread: right after ``prefetch`` returned, while a worker
    runs its get (``busy``), or after the prefetch ended (the same call, nothing running).
    The difference is how long the caller waits for the GIL while a worker runs."""
    t = mover.prefetch(keys, dest)
    if not busy:
        t.wait()
    t0 = time.perf_counter()
    time.sleep(0)
    us = (time.perf_counter() - t0) * 1e6
    t.wait()
    return us


def _spread(samples: list[float]) -> float:
    """(max - min) / median of the samples: how noisy a figure is."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def busy_gather(repeat: int) -> dict:
    """A CPU gather of 4096 one-token pages of 656 B x 8 layers through the public API
    against a Python loop of one ``memmove`` per row, while one busy process per core runs."""
    layers, n, row_bytes = 8, 4096, 656
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (layers, 2 * n, row_bytes),
                                             dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=n, page_tokens=1)
    perm = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n]
    token_pages, slots = perm.reshape(n, 1), torch.arange(n)
    rows = perm.tolist()
    src = [kv.layer("kv", i).data_ptr() for i in range(layers)]
    dst = [staging.tensor("kv")[i].data_ptr() for i in range(layers)]

    def memmove_loop():
        for s0, d0 in zip(src, dst, strict=True):
            for i, r in enumerate(rows):
                ctypes.memmove(d0 + i * row_bytes, s0 + r * row_bytes, row_bytes)

    def gather():
        kvmove.gather(kv, staging, token_pages, slots, check=False)

    cores = len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(cores)]
    try:
        time.sleep(0.5)
        us = median_us({"gather": gather, "memmove loop": memmove_loop},
                       repeat=max(3, repeat // 2), calls=1)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    staging.close()
    nbytes = layers * n * row_bytes
    return {"layers": layers, "pages": n, "row_bytes": row_bytes, "busy_processes": cores,
            "torch_threads": torch.get_num_threads(),
            "gather_GBps": nbytes / us["gather"] / 1e3,
            "memmove_loop_GBps": nbytes / us["memmove loop"] / 1e3,
            "busy_gather_over_memmove_loop": us["memmove loop"] / us["gather"]}


def run(repeat: int, device: torch.device = CPU, caches: tuple[str, ...] = CACHES) -> dict:
    """Every figure of the hot path on ``device``, for each way of giving the cache (the
    busy-machine gather on the CPU only). Target names are ``"<cache>: <figure>"``."""
    out: dict = {"one_page": {}, "prefetch": {}}
    figures = {}
    for cache in caches:
        out["one_page"][cache] = one_page(repeat, device, cache)
        figures.update({f"{cache}: {k}": out["one_page"][cache][k]
                        for k in ("one_page_gather", "one_page_scatter")})
    try:  # the prefetch figures need a store: a GPU machine may lack Mooncake
        find_master_binary()
    except StoreError as e:
        out["prefetch_skipped"] = str(e)
    else:
        with kvmove.MooncakeStore.embedded() as store:
            for cache in caches:
                out["prefetch"][cache] = prefetches(store, repeat, device, cache)
                figures.update({f"{cache}: {k}": out["prefetch"][cache][k]
                                for k in ("prefetch_return_us", "layerwise_over_whole")})
    if device.type == "cpu":
        out["busy"] = busy_gather(repeat)
        figures["busy_gather_over_memmove_loop"] = out["busy"]["busy_gather_over_memmove_loop"]
    out["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY") or "default"
    out["targets"] = {}
    for name, v in figures.items():
        figure = name.split(": ")[-1]
        target = TARGETS[figure]
        out["targets"][name] = {"value": v, "target": target,
                                "met": v >= target if figure.startswith("busy") else v <= target}
    return out


def report(result: dict, console: Console) -> None:
    table = Table(title="the hot path (medians of interleaved repeats)")
    for col in ("figure", "value", "target", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for name, f in result["targets"].items():
        table.add_row(name.replace("_", " "), f"{f['value']:.2f}", f"{f['target']:g}",
                      "yes" if f["met"] else "no")
    console.print(table)
    for cache, f in result.get("prefetch", {}).items():
        console.print(f"{cache}: the caller waits {f['gil_wait_us']:.1f} µs for the GIL while "
                      f"a worker runs the get (a GIL hand-off: {f['gil_release_busy_us']:.1f} "
                      f"µs busy, {f['gil_release_idle_us']:.1f} µs idle, spread "
                      f"{f['gil_release_busy_spread']:.2f})")
    for cache, figures in result.get("one_page", {}).items():
        for miss in figures.get("missed", []):
            console.print(f"one page, {cache}: misses 1.3x: {miss}")
    if "prefetch_skipped" in result:
        console.print(f"prefetch figures not measured: {result['prefetch_skipped']}")


def main(argv=None) -> int:
    """``python -m bench.bench_hot_path``: the hot-path figures alone, on the CPU (``--json
    PATH`` also writes them)."""
    p = argparse.ArgumentParser(prog="python -m bench.bench_hot_path",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = {"command": shlex.join(["python", "-m", "bench.bench_hot_path",
                                     *(sys.argv[1:] if argv is None else argv)]),
              **run(args.repeat, CPU, tuple(args.caches))}
    return results.finish_suite(result, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
