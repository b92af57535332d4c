"""``kvmove demo``: a simulated HiSparse decode loop on a synthetic DSA-like cache, moving
pages through a real Mooncake store, verifying every prefetched byte.

The model: a sequence of ``--pages`` logical pages, of which ``--resident`` fit in the
device hot buffer. Each decode step appends a token to the tail page (when it fills, it is
evicted to the store as its backup), selects the top-k pages that attention reads, prefetches
the selected pages that are not resident (evicting cold resident pages, LRU, to make room),
and verifies the prefetched rows against the bytes the page was created with. Slots are
scribbled over when a page leaves them, so a prefetch that wrote nothing cannot pass.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

import kvmove
from kvmove.cli import demo_options
from kvmove.cli.synthetic_pages import page_bytes
from kvmove.status import Status

log = logging.getLogger("kvmove.cli.demo")

KV_ROW = 656  # DSA FP8 MLA: 512 B fp8 nope + 64 rope bf16 (128 B) + scales (16 B)
INDEXER_ROW = 132  # fp8 indexer key (128 B) + fp32 scale


@dataclass
class Tally:
    steps: int = 0
    hits: int = 0  # selected pages already resident
    misses: int = 0  # selected pages prefetched
    evicted_cold: int = 0
    backups: int = 0
    verified_pages: int = 0
    verified_bytes: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: dict = field(default_factory=lambda: {s: 0 for s in Status})


class HotBuffer:
    """The device hot buffer: which logical page lives in which page of KV slots."""

    def __init__(self, kv: kvmove.KVCache, resident: int, page_tokens: int):
        self.kv = kv
        self.page_tokens = page_tokens
        self.free = list(range(resident))
        self.where: OrderedDict[int, int] = OrderedDict()  # page -> hot slot, LRU order

    def rows(self, hot_slots) -> torch.Tensor:
        hot = torch.as_tensor(hot_slots, dtype=torch.int64)
        return hot[:, None] * self.page_tokens + torch.arange(self.page_tokens)[None, :]

    def write(self, page: int, hot: int, tokens: slice) -> None:
        """Fill token rows ``tokens`` of ``page`` (at hot slot ``hot``) with its bytes."""
        for name in self.kv.buffer_names:
            layers, row = self.kv.num_layers(name), self.kv.row_bytes(name)
            want = page_bytes(page, name, layers, self.page_tokens, row)
            base = hot * self.page_tokens
            for layer in range(layers):
                self.kv.layer(name, layer)[base + tokens.start:base + tokens.stop] = (
                    want[layer, tokens].to(self.kv.device))

    def scribble(self, hot: int) -> None:
        """Overwrite a page's rows with junk when it leaves the hot buffer."""
        base = hot * self.page_tokens
        for name in self.kv.buffer_names:
            for layer in range(self.kv.num_layers(name)):
                self.kv.layer(name, layer)[base:base + self.page_tokens] = 0xA5

    def verify(self, page: int, hot: int) -> int:
        """Bytes verified; raises AssertionError naming the first wrong layer."""
        n = 0
        base = hot * self.page_tokens
        for name in self.kv.buffer_names:
            layers, row = self.kv.num_layers(name), self.kv.row_bytes(name)
            want = page_bytes(page, name, layers, self.page_tokens, row)
            for layer in range(layers):
                got = self.kv.layer(name, layer)[base:base + self.page_tokens].cpu()
                if not torch.equal(got, want[layer]):
                    raise AssertionError(f"page {page} buffer {name!r} layer {layer} differs")
                n += got.numel()
        return n


def make_cache(args) -> kvmove.KVCache:
    device = torch.device(args.device)
    slots = args.resident * args.page_tokens
    buffers = {"kv": torch.zeros(args.layers, slots, 1, KV_ROW, dtype=torch.uint8,
                                 device=device)}
    indexer_layers = args.layers if args.indexer_layers is None else args.indexer_layers
    if indexer_layers:
        buffers["indexer"] = torch.zeros(indexer_layers, slots, INDEXER_ROW, dtype=torch.uint8,
                                         device=device)
    return kvmove.KVCache(buffers)


def open_store(args):
    if args.master:
        return kvmove.MooncakeStore(kvmove.StoreConfig.from_env(master_address=args.master,
                                                                replicas=args.replicas))
    return kvmove.MooncakeStore.embedded(replicas=args.replicas)


def run(args, console: Console) -> Tally:
    rng = np.random.default_rng(args.seed)
    kv = make_cache(args)
    hot = HotBuffer(kv, args.resident, args.page_tokens)
    staging_slots = args.staging_slots or max(2 * args.topk + 2, 8)
    tally = Tally()
    stored: set[int] = set()
    # Start mid-sequence: the first pages exist already (prefilled, backed up, cold).
    first = min(args.pages - 1, args.resident)
    tail, fill = first, 0
    with open_store(args) as store, kvmove.KVMover(
        kv, store, page_tokens=args.page_tokens, staging_slots=staging_slots,
        backend=args.backend, key_prefix=f"demo{args.seed}-{time.time_ns()}", path=args.path,
    ) as mover:
        console.print(f"[bold]cache[/] {kv}")
        console.print(f"[bold]store[/] {store}")
        console.print(f"[bold]staging[/] {mover.staging}")
        choice = mover.path_choice
        console.print(f"[bold]path[/] evict {choice.evict}, prefetch {choice.prefetch} "
                      f"({choice.reason})")
        # Prefill: pages 0..first-1 are written, evicted to the store in batches.
        for start in range(0, first, args.topk):
            pages = list(range(start, min(first, start + args.topk)))
            slots = [hot.free.pop() for _ in pages]
            for p, s in zip(pages, slots, strict=True):
                hot.write(p, s, slice(0, args.page_tokens))
            t = mover.evict([f"p{p}" for p in pages], hot.rows(slots))
            tally_statuses(tally, t.wait())
            stored.update(pages)
            for s in slots:
                hot.scribble(s)
            hot.free.extend(slots)
        tail_hot = hot.free.pop()
        hot.where[tail] = tail_hot
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("decode", total=args.steps)
            for _ in range(args.steps):
                tail, fill, tail_hot = decode_step(args, rng, mover, hot, tally, stored,
                                                   tail, fill, tail_hot)
                progress.update(task, advance=1, description=(
                    f"decode: {tally.misses} prefetched, {tally.hits} hits, "
                    f"{tally.verified_bytes / 2**20:.0f} MiB verified"))
        tally.mover_stats = mover.stats()
        tally.staging_free_at_end = (mover.staging.num_free, mover.staging.num_slots)
    return tally


def tally_statuses(tally: Tally, statuses) -> None:
    for s in statuses:
        tally.statuses[s] += 1


def decode_step(args, rng, mover, hot, tally, stored, tail, fill, tail_hot):
    # 1. Backup of the newest token: append it to the tail page; a full page is evicted.
    hot.write(tail, tail_hot, slice(fill, fill + 1))
    fill += 1
    if fill == args.page_tokens:
        t = mover.evict([f"p{tail}"], hot.rows([tail_hot]))
        statuses = t.wait()
        tally_statuses(tally, statuses)
        if statuses[0] is Status.OK:
            stored.add(tail)
            tally.backups += 1
        else:
            tally.failures.append(f"backup of page {tail}: {statuses[0].name}")
        if tail + 1 < args.pages:
            tail, fill = tail + 1, 0
            hot.where.move_to_end(tail - 1)
            if not hot.free:
                make_room(args, mover, hot, tally, stored, 1, keep=set())
            tail_hot = hot.free.pop()
            hot.where[tail] = tail_hot
        else:
            fill = args.page_tokens - 1  # the sequence is full: keep rewriting its last token
    # 2. Top-k selection: half a preference for recent pages, half uniform, no tail page.
    candidates = np.array(sorted(stored))
    recency = np.exp(-(tail - candidates) / max(8.0, args.pages / 16))
    weights = recency / recency.sum() + 1.0 / candidates.size
    k = min(args.topk, candidates.size)
    chosen = rng.choice(candidates, size=k, replace=False, p=weights / weights.sum()).tolist()
    missing = [p for p in chosen if p not in hot.where]
    tally.hits += k - len(missing)
    tally.misses += len(missing)
    for p in chosen:
        if p in hot.where:
            hot.where.move_to_end(p)
    # 3. Prefetch the misses into free hot slots (evicting cold pages first).
    if missing:
        if len(hot.free) < len(missing):
            make_room(args, mover, hot, tally, stored, len(missing), keep=set(chosen) | {tail})
        slots = [hot.free.pop() for _ in missing]
        t = mover.prefetch([f"p{p}" for p in missing], hot.rows(slots), layerwise=args.layerwise)
        if args.layerwise:
            for layer in range(mover.kv.max_layers):
                t.wait_layer(layer)
        statuses = t.wait()
        tally_statuses(tally, statuses)
        for p, s, st in zip(missing, slots, statuses, strict=True):
            if st is not Status.OK:
                tally.failures.append(f"prefetch of page {p}: {st.name}")
                hot.free.append(s)
                continue
            try:
                tally.verified_bytes += hot.verify(p, s)
                tally.verified_pages += 1
            except AssertionError as e:
                tally.failures.append(str(e))
            hot.where[p] = s
    tally.steps += 1
    return tail, fill, tail_hot


def make_room(args, mover, hot, tally, stored, need, keep) -> None:
    """Evict cold resident pages (least recently used first) until ``need`` slots are free.
    Pages already in the store are dropped; others are put first."""
    victims = []
    for p in hot.where:
        if len(hot.free) + len(victims) >= need:
            break
        if p not in keep:
            victims.append(p)
    unsaved = [p for p in victims if p not in stored]
    if unsaved:
        t = mover.evict([f"p{p}" for p in unsaved], hot.rows([hot.where[p] for p in unsaved]))
        statuses = t.wait()
        tally_statuses(tally, statuses)
        stored.update(p for p, st in zip(unsaved, statuses, strict=True) if st is Status.OK)
    for p in victims:
        s = hot.where.pop(p)
        hot.scribble(s)
        hot.free.append(s)
        tally.evicted_cold += 1


def report(args, tally: Tally, seconds: float, console: Console) -> bool:
    s = tally.mover_stats
    ok = not tally.failures and tally.verified_pages == tally.misses
    ok = ok and tally.staging_free_at_end[0] == tally.staging_free_at_end[1]

    def gbps(nbytes, secs):
        return f"{nbytes / secs / 1e9:.2f}" if secs > 0 else "-"

    table = Table(title=f"kvmove demo: {args.steps} decode steps in {seconds:.1f} s "
                        f"({args.backend} backend, {args.device})", min_width=72)
    table.add_column("direction")
    table.add_column("pages", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("stage", justify="left")
    table.add_column("time (s)", justify="right")
    table.add_column("GB/s", justify="right")
    table.add_row("evict", str(s.pages_put), f"{s.bytes_put / 1e9:.3f}", "gather",
                  f"{s.gather_s:.3f}", gbps(s.bytes_put, s.gather_s))
    table.add_row("", "", "", "put", f"{s.put_s:.3f}", gbps(s.bytes_put, s.put_s))
    table.add_row("prefetch", str(s.pages_got), f"{s.bytes_got / 1e9:.3f}", "get",
                  f"{s.get_s:.3f}", gbps(s.bytes_got, s.get_s))
    table.add_row("", "", "", "scatter", f"{s.scatter_s:.3f}", gbps(s.bytes_got, s.scatter_s))
    console.print(table)
    counts = Table(title="pages")
    for col in ("top-k hits", "misses (prefetched)", "cold evictions", "backups", "statuses"):
        counts.add_column(col, justify="right")
    statuses = ", ".join(f"{k.name} {v}" for k, v in tally.statuses.items() if v)
    counts.add_row(str(tally.hits), str(tally.misses), str(tally.evicted_cold),
                   str(tally.backups), statuses)
    console.print(counts)
    if ok:
        console.print(f"[bold green]verified[/]: {tally.verified_pages} prefetched pages, "
                      f"{tally.verified_bytes / 2**20:.1f} MiB, every byte as evicted")
    else:
        console.print(f"[bold red]verification FAILED[/]: {len(tally.failures)} problem(s)")
        for line in tally.failures[:10]:
            console.print(f"  {line}")
        if tally.verified_pages != tally.misses:
            console.print(f"  {tally.misses - tally.verified_pages} prefetched page(s) "
                          f"not verified")
        if tally.staging_free_at_end[0] != tally.staging_free_at_end[1]:
            console.print(f"  staging slots leaked: {tally.staging_free_at_end}")
    return ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmove demo", description=__doc__)
    return demo_options.build_parser(parser)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    demo_options.check(parser, args)
    return run_main(args, parser)


def settle_device(parser: argparse.ArgumentParser, args) -> None:
    """``--device``: a torch device this machine has (``parser.error`` otherwise)."""
    on_gpu = torch.cuda.is_available()
    if args.device is None:
        args.device = "cuda" if on_gpu else "cpu"
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        parser.error(f"--device: {args.device!r} is not a torch device (e.g. cpu, cuda:0)")
    if device.type == "cuda":
        if not on_gpu:
            parser.error(f"--device {args.device}: CUDA is not available on this machine "
                         "(use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        parser.error(f"--device {args.device}: the demo runs on cpu or cuda")


def run_main(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    settle_device(parser, args)
    demo_options.settle_defaults(parser, args, on_gpu=torch.device(args.device).type == "cuda")
    console = Console()
    if args.direct:
        from kvmove.cli import direct_demo

        return direct_demo.run_main(args, console)
    if args.processes > 1:
        from kvmove.cli import cluster_demo

        return cluster_demo.run_main(args, console)
    if args.backend == "triton" and torch.device(args.device).type == "cpu":
        console.print("[yellow]note[/]: without a GPU the Triton backend runs in Triton's "
                      "interpreter, about a minute per decode step; --backend torch is the "
                      "CPU's fast path", soft_wrap=True)
    served = serve_metrics(args, console)
    t0 = time.perf_counter()
    try:
        tally = run(args, console)
    except kvmove.StoreError as e:  # one line: the cause (-v shows the store's log)
        console.print(f"[bold red]store error[/]: {str(e).splitlines()[0]}", soft_wrap=True)
        return 1
    ok = report(args, tally, time.perf_counter() - t0, console)
    if served and args.metrics_linger > 0:
        console.print(f"[bold]metrics[/] still served for {args.metrics_linger:g} s")
        time.sleep(args.metrics_linger)
    return 0 if ok else 1


def serve_metrics(args, console: Console) -> bool:
    """``--metrics-port`` (else ``$KVMOVE_METRICS_PORT``): serve kvmove's metrics for the
    run (``docs/METRICS.md``)."""
    from kvmove import metrics

    if args.metrics_port is not None:
        port = metrics.serve(args.metrics_port)
    elif (port := metrics.enable_from_env()) is None:
        return False
    console.print(f"[bold]metrics[/] http://127.0.0.1:{port}/metrics", soft_wrap=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
