"""Prefill -> decode host memory: the direct path (``kvmove.PageSender`` writes the pages
into a ``kvmove.PageReceiver``'s layer-first pool in another process, one network hop)
against the two-hop path through the store (the prefill process evicts the pages with a
``KVMover``, the decode process gets them into its pool with ``MooncakeStore.get`` of
``kvmove.describe(HostPool, ...)`` descriptors), same run, interleaved, medians.

DSA-sized pages by default: 61 layers x 16 tokens x 656-byte rows (0.64 MB a page). The
decode process is a process of its own; every run's pages are checked there, byte for
byte, outside the timed part (its pool pages are zeroed before each run, so a path that
wrote nothing cannot pass). The store's memory is the prefill process's segment (the
decode process gives none): the put is a write into the prefill process's own segment, the
get crosses to the decode process. Timed: direct = ``send(...).wait()``; two-hop =
``evict(...).wait()`` in the prefill process plus ``store.get`` in the decode process.

    python -m bench.bench_direct                  # table
    python -m bench.bench_direct --json out.json  # and the figures as JSON
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shlex
import statistics
import sys
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results
from kvmove.direct.handle import BufferPlace, PageHandle
from kvmove.direct.spans import plan_spans

METHODS = ("direct", "direct, scattered pages", "direct, layer by layer", "two-hop")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_direct", description=__doc__)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--pages", type=int, nargs="+", default=[8, 32], help="pages per call")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="32 pages, 3 repeats")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def page_crcs(rows: torch.Tensor, token_pages: torch.Tensor) -> list[int]:
    """CRC of each page's layer-first object (``rows``: ``[L, tokens, row]``)."""
    return [zlib.crc32(rows[:, tp].contiguous().numpy().tobytes())
            for tp in token_pages.tolist()]


# -- the decode process -----------------------------------------------------------------
def _decode(conn, master: str, layers: int, page_tokens: int, row: int, pages: int) -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    host = torch.zeros(layers, pages * page_tokens, row, dtype=torch.uint8)
    pool = kvmove.HostPool({"kv": host}, page_tokens=page_tokens, layout="layer_first")
    store = kvmove.MooncakeStore(kvmove.StoreConfig(
        master_address=master, global_segment_size=0, local_hostname="127.0.0.1"))
    rx = kvmove.PageReceiver(pool, hostname="127.0.0.1")
    conn.send(rx.handle)
    while True:
        op, args = conn.recv()
        if op == "exit":
            break
        if op == "get":
            keys, dst = args
            desc = kvmove.describe(pool, dst, keys)
            t0 = time.perf_counter()
            statuses = store.get(desc)
            conn.send(([s.value for s in statuses], time.perf_counter() - t0))
        elif op == "zero":
            for d in args:
                host[:, d * page_tokens:(d + 1) * page_tokens] = 0
            conn.send(None)
        elif op == "crc":
            conn.send(page_crcs(host, torch.tensor(args)[:, None] * page_tokens
                                + torch.arange(page_tokens)))
    rx.close()
    store.close()


class DecodeProcess:
    def __init__(self, master: str, args, pages: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode, daemon=True, args=(
            child, master, args.layers, args.page_tokens, args.row_bytes, pages))
        self.proc.start()
        child.close()
        self.handle = self._answer()

    def _answer(self, timeout: float = 120.0):
        if not self.conn.poll(timeout):
            raise TimeoutError("the decode process did not answer")
        return self.conn.recv()

    def call(self, op: str, args=None):
        self.conn.send((op, args))
        return self._answer()

    def close(self) -> None:
        self.conn.send(("exit", None))
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


# -- the prefill process (this one) ---------------------------------------------------------
def run(args) -> dict:
    n_max = max(args.pages)
    p, layers, row = args.page_tokens, args.layers, args.row_bytes
    g = torch.Generator().manual_seed(0)
    kv_rows = torch.randint(0, 256, (layers, 2 * n_max * p, row), dtype=torch.uint8,
                            generator=g)
    kv = kvmove.KVCache({"kv": kv_rows})
    rng = np.random.default_rng(0)
    samples = {(m, n): [] for m in METHODS for n in args.pages}
    send_returns = {n: [] for n in args.pages}  # seconds one layer's send takes to return
    spans = {}
    with kvmove.MooncakeStore.embedded(global_segment_size=1 << 30) as store:
        decode = DecodeProcess(store.address, args, 2 * n_max)
        try:
            with kvmove.PageSender(kv, page_tokens=p, staging_slots=n_max,
                                   hostname="127.0.0.1") as tx, \
                    kvmove.KVMover(kv, store, page_tokens=p, staging_slots=n_max,
                                   raw_keys=True) as mover:
                for r in range(args.repeat + 1):  # the first round warms up and is dropped
                    for n in args.pages:
                        token_pages = torch.arange(n * p).reshape(n, p) + r % 2 * n * p
                        want = page_crcs(kv_rows, token_pages)
                        runs = {
                            "direct": lambda tp=token_pages, n=n: _direct(tx, decode, tp,
                                                                          list(range(n))),
                            "direct, scattered pages": lambda tp=token_pages, n=n: _direct(
                                tx, decode, tp, rng.permutation(2 * n_max)[:n].tolist()),
                            "direct, layer by layer": lambda tp=token_pages, n=n, r=r: _direct(
                                tx, decode, tp, list(range(n)), layerwise=True,
                                issued=send_returns[n] if r else []),
                            "two-hop": lambda tp=token_pages, n=n: _two_hop(
                                mover, store, decode, tp, list(range(n))),
                        }
                        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
                        for method in order:
                            seconds, dst = runs[method]()
                            got = decode.call("crc", dst)
                            assert got == want, f"{method}: pages differ in the decode pool"
                            if r:
                                samples[(method, n)].append(seconds)
                    if r == 0:
                        spans = _span_counts(kv, decode.handle, args.pages, p)
        finally:
            decode.close()
    object_bytes = layers * p * row
    out = {"benchmark": "bench_direct", "command": args.command,
           "layers": layers, "page_tokens": p, "row_bytes": row, "pages": list(args.pages),
           "object_bytes": object_bytes, "repeats": args.repeat, "spans_per_send": spans,
           "median_s": {}, "spread": {}, "median_GBps": {}, "ratios": {},
           "layer_send_returns_us": {str(n): statistics.median(v) * 1e6
                                     for n, v in send_returns.items()}}
    for (method, n), s in samples.items():
        name = f"{method}, {n} pages"
        med = statistics.median(s)
        out["median_s"][name] = med
        out["spread"][name] = (max(s) - min(s)) / med
        out["median_GBps"][name] = n * object_bytes / med / 1e9
    for n in args.pages:
        two_hop = out["median_s"][f"two-hop, {n} pages"]
        for method in METHODS[:3]:
            out["ratios"][f"{method} vs two-hop, {n} pages (goal >= 2x)"
                          if method == "direct" else f"{method} vs two-hop, {n} pages"] = (
                two_hop / out["median_s"][f"{method}, {n} pages"])
    return out


def _direct(tx, decode, token_pages, dst, *, layerwise=False, issued=None):
    """Seconds until every page is in the decode pool; with ``layerwise``, one send per
    layer (and the mean time one ``send`` takes to return is added to ``issued``)."""
    decode.call("zero", dst)
    t0 = time.perf_counter()
    if layerwise:
        transfers = [tx.send(decode.handle, token_pages, dst, layers=layer)
                     for layer in range(tx.kv.max_layers)]
        issued.append((time.perf_counter() - t0) / len(transfers))
        statuses = [s for t in transfers for s in t.wait(60)]
    else:
        statuses = tx.send(decode.handle, token_pages, dst).wait(60)
    seconds = time.perf_counter() - t0
    assert all(s is kvmove.Status.OK for s in statuses), statuses[:3]
    return seconds, dst


def _two_hop(mover, store, decode, token_pages, dst):
    decode.call("zero", dst)
    keys = [f"{uuid.uuid4().hex[:12]}-{i}" for i in range(len(dst))]
    t0 = time.perf_counter()
    statuses = mover.evict(keys, token_pages).wait(60)
    evict_s = time.perf_counter() - t0
    assert all(s is kvmove.Status.OK for s in statuses), statuses[:3]
    got, get_s = decode.call("get", (keys, dst))
    assert got == ["ok"] * len(keys), got[:3]
    store.remove(keys, force=True)
    return evict_s + get_s, dst


def _span_counts(kv, handle, page_counts, p) -> dict:
    """Spans a send of consecutive pages into consecutive pages makes (all layers; one
    layer), as the sender plans them."""
    target = PageHandle.parse(handle)
    staging = kvmove.StagingBuffer(kv, num_slots=max(page_counts), page_tokens=p)
    places = [BufferPlace.of_view(n, staging.tensor(n), layout="layer_first",
                                  layers=kv.num_layers(n), row_bytes=kv.row_bytes(n),
                                  page_tokens=p, num_pages=staging.num_slots)
              for n in kv.buffer_names]
    out = {}
    for n in page_counts:
        args = (places, list(target.buffers), np.arange(n), np.arange(n), np.full(n, p))
        out[str(n)] = {"all layers": plan_spans(*args, None, p).num_spans,
                       "one layer": plan_spans(*args, 0, p).num_spans}
    return out


def report(result: dict, console: Console) -> None:
    table = Table(title=f"prefill -> decode host pool: {result['layers']} layers x "
                        f"{result['page_tokens']} tokens x {result['row_bytes']} B pages "
                        f"({result['object_bytes'] / 1e6:.2f} MB each), TCP on loopback")
    for col in ("method", "ms (median)", "GB/s", "spread"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, s in result["median_s"].items():
        table.add_row(name, f"{s * 1e3:.1f}", f"{result['median_GBps'][name]:.2f}",
                      f"{result['spread'][name]:.0%}")
    console.print(table)
    for name, value in result["ratios"].items():
        console.print(f"  {name}: [bold]{value:.2f}x[/]")
    for n, us in result["layer_send_returns_us"].items():
        console.print(f"  one layer's send returns after {us:.0f} µs ({n} pages; the write "
                      "goes on in the background)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = shlex.join(["python", "-m", "bench.bench_direct", *argv])
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's store client: errors only
    if args.quick:
        args.pages, args.repeat = [32], 3
    return results.finish_suite(run(args), report, args.json)


if __name__ == "__main__":
    sys.exit(main())
