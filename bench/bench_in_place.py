"""``KVMover`` on a host-memory KV cache against the in-place floor: the raw Mooncake client
reading (put) and writing (get) the KV rows where they are, one span per row of every layer
(what vLLM's own store connector does), through the same client and store, in the same run.

Two workloads:

- block rows: 96 blocks of 16 KiB x 32 layers, one row per block and layer (vLLM's KV
  blocks; ``page_tokens=1``), scattered block ids;
- token rows: 48 pages of 16 scattered 656-byte tokens x 61 layers (976 spans per key in
  place; HiSparse's DSA rows).

Methods, interleaved in every repeat (the order rotates; ``gc.collect()`` before every
timed call, then ``--settle`` seconds asleep, none by default): the floor
(``batch_is_exist`` + ``batch_put_from_multi_buffers``, the EXISTS check that gives the
mover's statuses; and ``batch_get_into_multi_buffers``), for reference the floor put without
the EXISTS check, the floor get issued from a worker thread and waited for (what a prefetch
that returns at once, as ``KVMover.prefetch`` does, cannot avoid: a thread hand-off), and
the floor with its span lists built inside its clock (numpy arithmetic and one
``tolist()``, as an engine's own connector builds them for every call), and ``KVMover``
evict + wait / prefetch + wait with ``path="auto"`` (what it picks is reported; built as by
default, and with ``prefetch_into_free_rows=True`` as the vLLM connector builds it),
``"staged"`` and ``"in_place"``. The floor's span lists are built before its clock starts:
it is the store's own time. Every get is checked byte for byte. The ratios
to the floor are medians of per-repeat ratios (each method against the floor of the same
repeat, measured within milliseconds of each other, so that the machine's load, which
drifts over seconds on a shared machine, cancels), with their quartiles.

``--settle`` measures a machine at rest between calls: on a 2-vCPU VM a thread that has
just run Python (``gc.collect()``, or an engine's own work) makes the next few ms of Mooncake
reads on it slower than a rested thread does, so the floor (made on the calling thread)
gains from a rest and a mover that reads on a worker thread does not.

    python -m bench.bench_in_place [--quick] [--repeat N] [--settle S] [--json PATH]
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
# mover name -> KVMover arguments: ``auto`` as built by default (prefetches stay staged),
# ``auto+free_rows`` as the vLLM connector builds it (its loads land in freshly allocated
# blocks: ``prefetch_into_free_rows=True`` lets ``auto`` take prefetches in place), and the
# two paths forced.
MOVERS = {
    "auto": {"path": "auto"},
    "auto+free_rows": {"path": "auto", "prefetch_into_free_rows": True},
    "staged": {"path": "staged"},
    "in_place": {"path": "in_place"},
}
PATHS = tuple(MOVERS)
# name -> (layers, row bytes, page tokens, pages, target: auto's time over the floor's)
WORKLOADS = {
    "block rows": (32, 16384, 1, 96, 1.05),
    "token rows": (61, 656, 16, 48, 1.0),
}
# The floor with its span lists made inside its clock (as an engine's own connector makes them
# for every call): what part of the gap to the floor is describing the rows at all.
SPANS_BUILT = "floor {op} (spans built in the clock)"


def workload_pages(pages: int, page_tokens: int, num_slots: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination pages of distinct, scattered slots (no two tokens of a page
    in consecutive slots: every slot used is even, in random order)."""
    g = torch.Generator().manual_seed(seed)
    slots = 2 * torch.randperm(num_slots // 2, generator=g)[: 2 * pages * page_tokens]
    return (slots[: pages * page_tokens].reshape(pages, page_tokens),
            slots[pages * page_tokens:].reshape(pages, page_tokens))


def floor_spans(kv_tensor: torch.Tensor, pages: torch.Tensor) -> list[list[int]]:
    """Per page, the address of each row of each layer in object order (layer by layer,
    the page's tokens in order): one span per row, nothing merged (no two are adjacent)."""
    base = kv_tensor.data_ptr()
    layer_step, pitch = kv_tensor.stride(0), kv_tensor.stride(1)
    layers = np.arange(kv_tensor.shape[0], dtype=np.int64)
    addr = base + layers[None, :, None] * layer_step + pages.numpy()[:, None, :] * pitch
    return addr.reshape(pages.shape[0], -1).tolist()


def run_workload(name: str, store, args) -> dict:
    layers, row_bytes, page_tokens, pages, target = WORKLOADS[name]
    if args.quick:
        pages = max(8, pages // 4)
    pages = args.pages or pages
    layers = args.layers or layers
    num_slots = 4 * pages * page_tokens + 2
    g = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 256, (layers, num_slots, row_bytes), dtype=torch.uint8,
                          generator=g)
    kv = kvmove.KVCache({"kv": cache})
    src, dst = workload_pages(pages, page_tokens, num_slots, seed=2)
    object_bytes = layers * page_tokens * row_bytes
    total = pages * object_bytes
    client = store.raw_client  # the floor talks to the same Mooncake client
    store.register([(cache.data_ptr(), cache.numel())])
    src_spans, dst_spans = floor_spans(cache, src), floor_spans(cache, dst)
    sizes = [[row_bytes] * (layers * page_tokens)] * pages
    movers = {p: kvmove.KVMover(kv, store, page_tokens=page_tokens, staging_slots=pages,
                                raw_keys=True, **MOVERS[p]) for p in PATHS}
    chosen = movers["auto"].path_choice
    chosen_free = movers["auto+free_rows"].path_choice
    want = [cache[:, s].clone() for s in src.reshape(-1).tolist()]

    def check_and_clear(tag: str) -> None:
        flat = dst.reshape(-1).tolist()
        for i, slot in enumerate(flat):
            assert torch.equal(cache[:, slot], want[i]), f"{name} {tag}: loaded bytes differ"
        cache[:, dst.reshape(-1)] = 0

    def floor_put(keys, exists_check=True, spans=src_spans):
        if spans is None:  # built in the clock
            spans = floor_spans(cache, src)
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
            spans = floor_spans(cache, dst)
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
    cache[:, dst.reshape(-1)] = 0
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
    for m in movers.values():
        m.close()
    worker.shutdown()
    store.unregister([(cache.data_ptr(), cache.numel())])
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
        "workload": name, "layers": layers, "row_bytes": row_bytes,
        "page_tokens": page_tokens, "pages": pages, "object_bytes": object_bytes,
        "total_bytes": total, "spans_per_key_in_place": layers * page_tokens,
        "repeats": args.repeat, "settle_s": args.settle,
        "auto_path": chosen.path, "auto_reason": chosen.reason,
        "auto_free_rows_path": chosen_free.path, "auto_free_rows_reason": chosen_free.reason,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in rows.items()},
        "over_floor": ratio, "over_floor_quartiles": quartiles, "target": target,
        "met": {op: ratio[f"auto {op}"] <= target for op in ("put", "get")},
        "met_free_rows": {op: ratio[f"auto+free_rows {op}"] <= target for op in ("put", "get")},
    }


def run(args) -> dict:
    segment = 3 << 30
    out = []
    with kvmove.MooncakeStore.embedded(global_segment_size=segment) as store:
        for name in WORKLOADS:
            out.append(run_workload(name, store, args))
    return {
        "benchmark": "bench_in_place", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join(["python -m bench.bench_in_place", *sys.argv[1:]]),
        "in_place": out,
    }


def report(result: dict, console: Console) -> None:
    for w in result["in_place"]:
        table = Table(title=f"{w['workload']}: {w['pages']} pages x {w['page_tokens']} tokens "
                            f"x {w['row_bytes']} B x {w['layers']} layers "
                            f"({w['object_bytes'] / 1024:.0f} KiB objects, "
                            f"{w['spans_per_key_in_place']} spans per key in place), "
                            f"median of {w['repeats']}"
                            + (f", {w['settle_s'] * 1e3:g} ms asleep before each call"
                               if w.get("settle_s") else ""))
        for col in ("method", "median ms", "spread", "/ floor (paired, quartiles)"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for op in ("put", "get"):
            for k, v in w["median_ms"].items():
                if k.endswith(op) or (op in k and "(" in k):
                    pair = k.removeprefix("KVMover ")
                    q = w["over_floor_quartiles"].get(pair)
                    table.add_row(k, f"{v:.2f}", f"{w['spread'][k] * 100:.0f}%",
                                  f"{w['over_floor'][pair]:.2f}x ({q[0]:.2f}-{q[1]:.2f})"
                                  if q else "")
        console.print(table)
        marks = {op: "met" if w["met"][op] else "MISSED" for op in ("put", "get")}
        console.print(f"auto picked {w['auto_path']} ({w['auto_reason']}); its time over the "
                      f"floor: put {w['over_floor']['auto put']:.2f}x ({marks['put']}), "
                      f"get {w['over_floor']['auto get']:.2f}x ({marks['get']}); target "
                      f"<= {w['target']:g}x")
        marks = {op: "met" if w["met_free_rows"][op] else "MISSED" for op in ("put", "get")}
        console.print(f"with prefetch_into_free_rows=True auto picked "
                      f"{w['auto_free_rows_path']}: put "
                      f"{w['over_floor']['auto+free_rows put']:.2f}x ({marks['put']}), get "
                      f"{w['over_floor']['auto+free_rows get']:.2f}x ({marks['get']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_in_place",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a quarter of the pages, 3 repeats")
    p.add_argument("--pages", type=int, default=None, help="pages per call (both workloads)")
    p.add_argument("--layers", type=int, default=None, help="layers (both workloads)")
    p.add_argument("--settle", type=float, default=0.0, metavar="S",
                   help="seconds asleep after the gc.collect() before every timed call "
                        "(a machine at rest between calls; default 0)")
    p.add_argument("--json", nargs="?", const=str(RESULTS / "bench_in_place.json"),
                   default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.settle <= 10:
        p.error(f"--settle must be 0-10 seconds, got {args.settle}")
    if args.quick:
        args.repeat = 3
    return results.finish_suite(run(args), report, Path(args.json) if args.json else None)


if __name__ == "__main__":
    sys.exit(main())
