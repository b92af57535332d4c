"""``KVMover`` on a host-memory KV cache against the in-place floor: the raw Mooncake client
reading (put) and writing (get) the KV rows where they are, one span per row of every layer
(what vLLM's own store connector does), through the same client and store, in the same run.

Two kinds of rows, each on a stacked cache (one ``[layers, slots, row]`` tensor) and on
per-layer tensors (SGLang's pools; one allocation per layer), 1 to 4,096 pages per call:

- block rows: blocks of 16 KiB x 32 layers, one row per block and layer (vLLM's KV
  blocks; ``page_tokens=1``), scattered block ids; goal <= 1.05x the floor;
- token rows: pages of 16 scattered 656-byte tokens x 61 layers (976 spans per key in
  place; HiSparse's DSA rows); goal <= 1.0x.

A call is capped at 128 MiB: larger page counts run with fewer layers (the table says so).
A goal is met where the upper quartile of the paired ratios is within it, missed where the
lower quartile is above it, and otherwise reported as within the run's noise.

Methods, interleaved in every repeat (the order rotates; ``gc.collect()`` before every
timed call, then ``--settle`` seconds asleep, none by default): the floor
(``batch_is_exist`` + ``batch_put_from_multi_buffers``, the EXISTS check that gives the
mover's statuses; and ``batch_get_into_multi_buffers``), for reference the floor put without
the EXISTS check, the floor get issued from a worker thread and waited for (what a prefetch
that returns at once, as ``KVMover.prefetch`` does, cannot avoid: a thread hand-off), and
the floor with its span lists built inside its clock (numpy arithmetic and one
``tolist()``, as an engine's own connector builds them for every call), and ``KVMover``
evict + wait / prefetch + wait with ``path="auto"`` (what it picks is reported; built as by
default, and with ``keep_failed_rows=True``, which stages prefetches to keep a failed key's
rows untouched), ``"staged"`` and ``"in_place"``. The floor's span lists are built before
its clock starts: it is the store's own time. Every get is checked byte for byte. The ratios
to the floor are medians of per-repeat ratios (each method against the floor of the same
repeat, measured within milliseconds of each other, so that the machine's load, which
drifts over seconds on a shared machine, cancels), with their quartiles.

``--settle`` measures a machine at rest between calls: on a 2-vCPU VM a thread that has
just run Python (``gc.collect()``, or an engine's own work) makes the next few ms of Mooncake
reads on it slower than a rested thread does, so the floor (made on the calling thread)
gains from a rest and a mover that reads on a worker thread does not.

    python -m bench.bench_in_place [--quick] [--repeat N] [--pages N ...] [--settle S]
                                   [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results

RESULTS = Path(__file__).resolve().parent / "results"
# mover name -> KVMover arguments: ``auto`` as built by default (prefetches in place where
# that measures faster), ``auto+keep`` with ``keep_failed_rows=True`` (prefetches staged, so
# that a failed key's rows stay untouched), and the two paths forced.
MOVERS = {
    "auto": {"path": "auto"},
    "auto+keep": {"path": "auto", "keep_failed_rows": True},
    "staged": {"path": "staged"},
    "in_place": {"path": "in_place"},
}
PATHS = tuple(MOVERS)
# kind -> (layers, row bytes, page tokens, target: auto's time over the floor's)
KINDS = {
    "block rows": (32, 16384, 1, 1.05),
    "token rows": (61, 656, 16, 1.0),
}
CACHES = ("stacked", "per_layer")
PAGES = (1, 16, 256, 4096)
QUICK_PAGES = (1, 16, 64)
CALL_BYTES = 128 << 20  # at most this many bytes per call: fewer layers where more pages
# The floor with its span lists made inside its clock (as an engine's own connector makes them
# for every call): what part of the gap to the floor is describing the rows at all.
SPANS_BUILT = "floor {op} (spans built in the clock)"


def layers_within(layers: int, pages: int, page_tokens: int, row_bytes: int) -> int:
    """``layers``, or fewer so that one call moves at most :data:`CALL_BYTES`."""
    return max(1, min(layers, CALL_BYTES // (pages * page_tokens * row_bytes)))


def verdict(ratios: list[float], target: float) -> str:
    """``met`` where the upper quartile of ``ratios`` is within ``target``, ``missed`` where
    the lower quartile is above it, else ``within noise``."""
    q1, q3 = np.quantile(ratios, [0.25, 0.75])
    return "met" if q3 <= target else "missed" if q1 > target else "within noise"


def layer_tensors(cache: str, layers: int, num_slots: int, row_bytes: int,
                  g: torch.Generator) -> tuple[object, list[torch.Tensor]]:
    """The KV rows as given to ``KVCache`` (a stacked tensor or per-layer tensors) and as
    one ``[slots, row_bytes]`` tensor per layer."""
    if cache == "stacked":
        t = torch.randint(0, 256, (layers, num_slots, row_bytes), dtype=torch.uint8,
                          generator=g)
        return t, list(t.unbind(0))
    ts = [torch.randint(0, 256, (num_slots, row_bytes), dtype=torch.uint8, generator=g)
          for _ in range(layers)]
    return ts, ts


def workload_pages(pages: int, page_tokens: int, num_slots: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination pages of distinct, scattered slots (no two tokens of a page
    in consecutive slots: every slot used is even, in random order)."""
    g = torch.Generator().manual_seed(seed)
    slots = 2 * torch.randperm(num_slots // 2, generator=g)[: 2 * pages * page_tokens]
    return (slots[: pages * page_tokens].reshape(pages, page_tokens),
            slots[pages * page_tokens:].reshape(pages, page_tokens))


def floor_spans(layers: list[torch.Tensor], pages: torch.Tensor) -> list[list[int]]:
    """Per page, the address of each row of each layer in object order (layer by layer,
    the page's tokens in order): one span per row, nothing merged (no two are adjacent)."""
    bases = np.array([t.data_ptr() for t in layers], dtype=np.int64)
    addr = bases[None, :, None] + pages.numpy()[:, None, :] * layers[0].stride(0)
    return addr.reshape(pages.shape[0], -1).tolist()


def run_workload(kind: str, cache_kind: str, pages: int, store, args) -> dict:
    layers, row_bytes, page_tokens, target = KINDS[kind]
    layers = layers_within(args.layers or layers, pages, page_tokens, row_bytes)
    num_slots = 4 * pages * page_tokens + 2
    given, per_layer = layer_tensors(cache_kind, layers, num_slots, row_bytes,
                                     torch.Generator().manual_seed(1))
    kv = kvmove.KVCache({"kv": given})
    src, dst = workload_pages(pages, page_tokens, num_slots, seed=2)
    object_bytes = layers * page_tokens * row_bytes
    client = store.raw_client  # the floor talks to the same Mooncake client
    regions = [(t.data_ptr(), t.numel()) for t in per_layer]
    if cache_kind == "stacked":
        regions = [(given.data_ptr(), given.numel())]
    store.register(regions)
    src_spans, dst_spans = floor_spans(per_layer, src), floor_spans(per_layer, dst)
    sizes = [[row_bytes] * (layers * page_tokens)] * pages
    movers = {p: kvmove.KVMover(kv, store, page_tokens=page_tokens, staging_slots=pages,
                                raw_keys=True, **MOVERS[p]) for p in PATHS}
    src_flat, dst_flat = src.reshape(-1), dst.reshape(-1)

    def rows_of(slots: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.index_select(0, slots) for t in per_layer])

    want = rows_of(src_flat)

    def check_and_clear(tag: str) -> None:
        assert torch.equal(rows_of(dst_flat), want), f"{kind} {tag}: loaded bytes differ"
        for t in per_layer:
            t.index_fill_(0, dst_flat, 0)

    def floor_put(keys, exists_check=True, spans=src_spans):
        if spans is None:  # built in the clock
            spans = floor_spans(per_layer, src)
        todo = range(pages)
        if exists_check:
            flags = client.batch_is_exist(keys)
            todo = [i for i, f in enumerate(flags) if f != 1]
        codes = client.batch_put_from_multi_buffers([keys[i] for i in todo],
                                                    [spans[i] for i in todo],
                                                    [sizes[i] for i in todo])
        assert all(c == 0 for c in codes), codes[:4]

    def floor_get(keys, spans=dst_spans):
        if spans is None:  # built in the clock
            spans = floor_spans(per_layer, dst)
        codes = client.batch_get_into_multi_buffers(keys, spans, sizes)
        assert codes == [object_bytes] * pages, codes[:4]

    def settle() -> None:  # outside the clock, before every timed call alike
        gc.collect()
        if args.settle:
            time.sleep(args.settle)

    worker = ThreadPoolExecutor(max_workers=1)

    def mover_put(path, keys):
        assert movers[path].evict(keys, src).wait() == [kvmove.Status.OK] * pages

    def mover_get(path, keys):
        assert movers[path].prefetch(keys, dst).wait() == [kvmove.Status.OK] * pages

    names = ["floor", *(f"KVMover {p}" for p in PATHS)]
    rows: dict[str, list[float]] = {}
    for t in per_layer:
        t.index_fill_(0, dst_flat, 0)
    for r in range(args.warmup + args.repeat):
        k = r % len(names)
        order = names[k:] + names[:k]
        times: dict[str, float] = {}
        keys = {who: [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(pages)] for who in names}
        keys["floor (no EXISTS check)"] = [f"{uuid.uuid4().hex[:12]}-n{i}" for i in range(pages)]
        keys["floor (spans built)"] = [f"{uuid.uuid4().hex[:12]}-b{i}" for i in range(pages)]
        for who in order:
            settle()
            t0 = time.perf_counter()
            if who == "floor":
                floor_put(keys[who])
            else:
                mover_put(who.split()[1], keys[who])
            times[f"{who} put"] = time.perf_counter() - t0
            if who == "floor":
                settle()
                t0 = time.perf_counter()
                floor_put(keys["floor (no EXISTS check)"], exists_check=False)
                times["floor put (no EXISTS check)"] = time.perf_counter() - t0
                settle()
                t0 = time.perf_counter()
                floor_put(keys["floor (spans built)"], spans=None)
                times[SPANS_BUILT.format(op="put")] = time.perf_counter() - t0
        for who in order:
            settle()
            t0 = time.perf_counter()
            if who == "floor":
                floor_get(keys[who])
            else:
                mover_get(who.split()[1], keys[who])
            times[f"{who} get"] = time.perf_counter() - t0
            check_and_clear(who)
            if who == "floor":
                settle()
                t0 = time.perf_counter()
                worker.submit(floor_get, keys[who]).result()
                times["floor get (from a worker thread)"] = time.perf_counter() - t0
                check_and_clear("floor from a worker thread")
                settle()
                t0 = time.perf_counter()
                floor_get(keys[who], spans=None)
                times[SPANS_BUILT.format(op="get")] = time.perf_counter() - t0
                check_and_clear("floor with its spans built in the clock")
        store.remove([k for ks in keys.values() for k in ks], force=True)
        if r >= args.warmup:
            for what, s in times.items():
                rows.setdefault(what, []).append(s)
    chosen = {p: movers[p].path_choice for p in ("auto", "auto+keep")}
    for m in movers.values():
        m.close()
    worker.shutdown()
    store.unregister(regions)
    med = {k: statistics.median(v) for k, v in rows.items()}
    paired = {f"{who} {op}": [a / b for a, b in zip(rows[f"KVMover {who} {op}"],
                                                    rows[f"floor {op}"], strict=True)]
              for who in PATHS for op in ("put", "get")}
    for ref, op in (("floor put (no EXISTS check)", "put"),
                    ("floor get (from a worker thread)", "get"),
                    (SPANS_BUILT.format(op="put"), "put"), (SPANS_BUILT.format(op="get"), "get")):
        paired[ref] = [a / b for a, b in zip(rows[ref], rows[f"floor {op}"], strict=True)]
    ratio = {k: statistics.median(v) for k, v in paired.items()}
    quartiles = {k: [float(q) for q in np.quantile(v, [0.25, 0.75])]
                 for k, v in paired.items()}
    return {
        "workload": kind, "cache": cache_kind, "layers": layers, "row_bytes": row_bytes,
        "page_tokens": page_tokens, "pages": pages, "object_bytes": object_bytes,
        "total_bytes": pages * object_bytes, "spans_per_key_in_place": layers * page_tokens,
        "repeats": args.repeat, "settle_s": args.settle,
        "auto_path": chosen["auto"].path, "auto_reason": chosen["auto"].reason,
        "auto_keep_path": chosen["auto+keep"].path,
        "auto_keep_reason": chosen["auto+keep"].reason,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in rows.items()},
        "over_floor": ratio, "over_floor_quartiles": quartiles, "target": target,
        "verdict": {op: verdict(paired[f"auto {op}"], target) for op in ("put", "get")},
        "verdict_keep": {op: verdict(paired[f"auto+keep {op}"], target)
                         for op in ("put", "get")},
    }


def run(args) -> dict:
    segment = 3 << 30
    out = []
    pages = args.pages or (QUICK_PAGES if args.quick else PAGES)
    with kvmove.MooncakeStore.embedded(global_segment_size=segment) as store:
        for kind in KINDS:
            for cache in args.caches:
                for n in pages:
                    out.append(run_workload(kind, cache, n, store, args))
                    log_line(out[-1])
    return {
        "benchmark": "bench_in_place", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join(["python -m bench.bench_in_place", *sys.argv[1:]]),
        "in_place": out,
    }


def log_line(w: dict) -> None:
    print(f"{w['workload']}, {w['cache']}, {w['pages']} pages x {w['layers']} layers: auto "
          f"{w['auto_path']} put {w['over_floor']['auto put']:.2f}x ({w['verdict']['put']}), "
          f"get {w['over_floor']['auto get']:.2f}x ({w['verdict']['get']})", flush=True)


def summary_rows(w: dict) -> list[str]:
    """The cells of one workload in the summary: what ``auto`` picked and its put and get
    over the floor (median of paired ratios, quartiles, verdict), and the same with
    ``keep_failed_rows=True``."""

    def cell(who: str, op: str) -> str:
        q = w["over_floor_quartiles"][f"{who} {op}"]
        said = w["verdict" if who == "auto" else "verdict_keep"][op]
        return f"{w['over_floor'][f'{who} {op}']:.2f}x ({q[0]:.2f}-{q[1]:.2f}) {said}"

    return [w["workload"], w["cache"], str(w["pages"]), str(w["layers"]), w["auto_path"],
            cell("auto", "put"), cell("auto", "get"), w["auto_keep_path"],
            cell("auto+keep", "get"), f"<= {w['target']:g}x"]


SUMMARY_COLUMNS = ("rows", "cache", "pages", "layers", "auto path", "auto put / floor",
                   "auto get / floor", "keep path", "keep get / floor", "goal")


def report(result: dict, console: Console) -> None:
    ws = result["in_place"]
    table = Table(title=f"KVMover over the in-place floor (median of paired ratios, "
                        f"quartiles), {ws[0]['repeats']} repeats"
                        + (f", {ws[0]['settle_s'] * 1e3:g} ms asleep before each call"
                           if ws[0].get("settle_s") else ""))
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="left" if col in ("rows", "cache") else "right")
    for w in ws:
        table.add_row(*summary_rows(w))
    console.print(table)
    for w in ws:
        console.print(f"{w['workload']}, {w['cache']}, {w['pages']} pages: auto: "
                      f"{w['auto_reason']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_in_place",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer page counts, 3 repeats")
    p.add_argument("--pages", type=int, nargs="+", default=None,
                   help=f"pages per call (default {' '.join(map(str, PAGES))}; quick "
                        f"{' '.join(map(str, QUICK_PAGES))})")
    p.add_argument("--layers", type=int, default=None, help="layers (both kinds of rows)")
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES),
                   help="stacked tensor, per-layer tensors, or both (default)")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="seconds asleep after the gc.collect() before every timed call "
                        "(a machine at rest between calls; default 0)")
    p.add_argument("--json", nargs="?", const=str(RESULTS / "bench_in_place.json"),
                   default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.settle <= 10:
        p.error(f"--settle must be 0-10 seconds, got {args.settle}")
    if args.pages and min(args.pages) < 1:
        p.error(f"--pages must be at least 1, got {min(args.pages)}")
    if args.quick:
        args.repeat = 3
    return results.finish_suite(run(args), report, Path(args.json) if args.json else None)


if __name__ == "__main__":
    sys.exit(main())
