"""Benchmark of the store half of kvmove.

1. Descriptor build: ``kvmove.describe`` for K keys x L layers (one buffer of 656-byte
   rows, like DSA FP8 MLA) against the per-(page, layer) Python loop SGLang uses
   (``get_page_buffer_meta`` then ``_pack_multi_buffer_meta``), and against the floor: the
   ``tolist()`` of the finished ``[K, L]`` pointer array alone, which any builder feeding
   Mooncake's list-based API pays. Targets: >= 3x the loop, <= 1.5x the floor.
2. Put/get GB/s through ``MooncakeStore`` (multi-buffer descriptors, one span per layer,
   zero copy from layer-first staging) against raw ``batch_put_from``/``batch_get_into`` of
   the same bytes laid out contiguously (one span per key). Target: >= 0.8x.

    python -m bench.bench_store                 # prints a table
    python -m bench.bench_store --json          # and writes bench/results/bench_store.json

The staging memory is anonymous ``mmap`` that describe() never touches, so the descriptor
part can use the full 4096-slot x 64-token geometry (10.5 GB of address space, no RAM).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results

RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t0)
        del result
    return out


def sglang_loop(staging, name: str, slots: torch.Tensor, keys: list[str]):
    """Pointer and size lists the way SGLang builds them for a layer-first MLA host pool:
    a Python loop over (page, layer), then regrouped per key."""
    t = staging.tensor(name)
    base, layer_stride, slot_stride = t.data_ptr(), t.stride(0), t.stride(1)
    layer_num, element_size = t.shape[0], t.shape[2]
    ptr_list = []
    for slot in slots.tolist():
        for layer_id in range(layer_num):
            ptr_list.append(base + slot * slot_stride + layer_id * layer_stride)
    element_size_list = [element_size] * len(ptr_list)
    nbuf = len(ptr_list) // len(keys)
    packed_ptrs, packed_sizes = [], []
    for i in range(len(keys)):
        start = i * nbuf
        packed_ptrs.append(ptr_list[start:start + nbuf])
        packed_sizes.append(element_size_list[start:start + nbuf])
    return packed_ptrs, packed_sizes


def bench_describe(args) -> dict:
    kv = kvmove.KVCache({"kv": torch.zeros(args.layers, 8, args.row_bytes, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=args.keys, page_tokens=args.page_tokens)
    keys = [f"{uuid.uuid4().hex}_0__k" for _ in range(args.keys)]
    slots = torch.randperm(args.keys)
    desc = kvmove.describe(staging, slots, keys)
    ptrs, sizes = sglang_loop(staging, "kv", slots, keys)
    assert desc.ptrs == ptrs and desc.sizes == sizes, "describe and the loop disagree"
    finished = np.array(desc.ptrs, dtype=np.int64)
    times: dict[str, list[float]] = {"describe": [], "loop": [], "floor": []}
    for _ in range(args.repeat):  # interleaved, so that machine noise hits all three
        times["describe"] += _timed(lambda: kvmove.describe(staging, slots, keys), 1)
        times["loop"] += _timed(lambda: sglang_loop(staging, "kv", slots, keys), 1)
        times["floor"] += _timed(finished.tolist, 1)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "keys": args.keys, "layers": args.layers, "row_bytes": args.row_bytes,
        "page_tokens": args.page_tokens, "spans": desc.num_spans,
        "best_s": best, "median_s": med,
        "speedup_vs_loop": best["loop"] / best["describe"],
        "ratio_to_floor": best["describe"] / best["floor"],
        "median_speedup_vs_loop": med["loop"] / med["describe"],
        "median_ratio_to_floor": med["describe"] / med["floor"],
    }


def bench_transfer(args) -> dict:
    layers, row_bytes, page_tokens, n = args.layers, args.row_bytes, args.store_page_tokens, \
        args.store_keys
    kv = kvmove.KVCache({"kv": torch.zeros(layers, 8, row_bytes, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=2 * n, page_tokens=page_tokens)
    t = staging.tensor("kv")
    t[:, :n].copy_(torch.randint(0, 256, t[:, :n].shape, dtype=torch.uint8))
    object_bytes = staging.object_bytes
    total = n * object_bytes
    # The same objects, page-first and contiguous: the raw baseline's source and destination.
    flat_src = t[:, :n].permute(1, 0, 2).contiguous().reshape(-1)
    flat_dst = torch.zeros_like(flat_src)
    src_slots, dst_slots = torch.arange(n), torch.arange(n, 2 * n)
    segment = max(1 << 30, 3 * total)
    rows: dict[str, list[float]] = {
        "raw put": [], "store put": [], "store put (no EXISTS check)": [],
        "raw get": [], "store get": [],
    }
    with kvmove.MooncakeStore.embedded(global_segment_size=segment) as store:
        store.register(staging)
        store.register([(flat_src.data_ptr(), flat_src.numel()),
                        (flat_dst.data_ptr(), flat_dst.numel())])
        client = store.raw_client  # the raw baseline talks to the same client
        raw_ptrs = [flat_src.data_ptr() + i * object_bytes for i in range(n)]
        raw_dst = [flat_dst.data_ptr() + i * object_bytes for i in range(n)]
        sizes = [object_bytes] * n

        def keys_for(tag):
            return [f"{uuid.uuid4().hex[:8]}/{tag}{i}" for i in range(n)]

        for _ in range(args.store_repeat):
            raw_keys, keys, keys2 = keys_for("raw"), keys_for("kvm"), keys_for("kvm2")
            desc = kvmove.describe(staging, src_slots, keys)
            desc2 = kvmove.describe(staging, src_slots, keys2)
            get_desc = kvmove.describe(staging, dst_slots, keys)

            t0 = time.perf_counter()
            codes = client.batch_put_from(raw_keys, raw_ptrs, sizes)
            rows["raw put"].append(time.perf_counter() - t0)
            assert all(c == 0 for c in codes), codes[:4]
            t0 = time.perf_counter()
            assert store.put(desc).all_ok
            rows["store put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert store.put(desc2, detect_exists=False).all_ok
            rows["store put (no EXISTS check)"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            codes = client.batch_get_into(raw_keys, raw_dst, sizes)
            rows["raw get"].append(time.perf_counter() - t0)
            assert codes == sizes, codes[:4]
            t0 = time.perf_counter()
            assert store.get(get_desc).all_ok
            rows["store get"].append(time.perf_counter() - t0)
            assert torch.equal(t[:, n:], t[:, :n]) and torch.equal(flat_dst, flat_src)
            t[:, n:].zero_()
            flat_dst.zero_()
            store.remove(raw_keys + keys + keys2, force=True)
    best = {k: total / min(v) / 1e9 for k, v in rows.items()}
    med = {k: total / statistics.median(v) / 1e9 for k, v in rows.items()}
    return {
        "keys": n, "layers": layers, "row_bytes": row_bytes, "page_tokens": page_tokens,
        "object_bytes": object_bytes, "span_bytes": page_tokens * row_bytes,
        "total_bytes": total, "best_GBps": best, "median_GBps": med,
        "put_ratio": best["store put"] / best["raw put"],
        "put_ratio_no_exists_check": best["store put (no EXISTS check)"] / best["raw put"],
        "get_ratio": best["store get"] / best["raw get"],
    }


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]NO[/red]"


def report(result: dict, console: Console) -> None:
    d = result.get("describe")
    if d:
        table = Table(title=f"descriptor build: {d['keys']} keys x {d['layers']} layers "
                            f"({d['row_bytes']} B rows, {d['page_tokens']} tokens/page, "
                            f"{d['spans']} spans)")
        for col in ("builder", "best ms", "median ms", "vs describe (best)"):
            table.add_column(col, justify="right" if col != "builder" else "left")
        names = {"describe": "kvmove.describe", "loop": "SGLang-style loop",
                 "floor": "floor: ptr_array.tolist()"}
        for k, label in names.items():
            table.add_row(label, f"{d['best_s'][k] * 1e3:.2f}", f"{d['median_s'][k] * 1e3:.2f}",
                          f"{d['best_s'][k] / d['best_s']['describe']:.2f}x")
        console.print(table)
        console.print(
            f"describe is {d['speedup_vs_loop']:.1f}x faster than the loop (target >= 3: "
            f"{_mark(d['speedup_vs_loop'] >= 3)}) and {d['ratio_to_floor']:.2f}x the floor "
            f"(target <= 1.5: {_mark(d['ratio_to_floor'] <= 1.5)}); medians "
            f"{d['median_speedup_vs_loop']:.1f}x / {d['median_ratio_to_floor']:.2f}x"
        )
    s = result.get("transfer")
    if s:
        table = Table(title=f"put/get over loopback TCP: {s['keys']} objects of "
                            f"{s['object_bytes'] / 2**20:.2f} MiB ({s['layers']} spans of "
                            f"{s['span_bytes'] / 1024:.0f} KiB vs 1 contiguous span)")
        for col in ("path", "best GB/s", "median GB/s"):
            table.add_column(col, justify="right" if col != "path" else "left")
        for k in s["best_GBps"]:
            table.add_row(k, f"{s['best_GBps'][k]:.2f}", f"{s['median_GBps'][k]:.2f}")
        console.print(table)
        console.print(
            f"store/raw: put {s['put_ratio']:.2f}x ({_mark(s['put_ratio'] >= 0.8)}; "
            f"{s['put_ratio_no_exists_check']:.2f}x without the EXISTS check), "
            f"get {s['get_ratio']:.2f}x ({_mark(s['get_ratio'] >= 0.8)}); target >= 0.8"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=4096, help="keys for the descriptor build")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--page-tokens", type=int, default=64, help="descriptor build geometry")
    p.add_argument("--repeat", type=int, default=15, help="descriptor build repetitions")
    p.add_argument("--store-keys", type=int, default=64, help="objects per put/get batch")
    p.add_argument("--store-page-tokens", type=int, default=64)
    p.add_argument("--store-repeat", type=int, default=5)
    p.add_argument("--skip-describe", action="store_true")
    p.add_argument("--skip-store", action="store_true")
    p.add_argument("--json", nargs="?", const=str(RESULTS / "bench_store.json"), default=None,
                   metavar="PATH", help="also write the results as JSON (default path: "
                                        "bench/results/bench_store.json)")
    args = p.parse_args(argv)
    console = Console()
    result = {
        "benchmark": "bench_store", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join(["python -m bench.bench_store", *(argv or sys.argv[1:])]),
    }
    if not args.skip_describe:
        result["describe"] = bench_describe(args)
    if not args.skip_store:
        result["transfer"] = bench_transfer(args)
    report(result, console)
    if args.json:
        path = Path(args.json)
        results.save(result, path)
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
