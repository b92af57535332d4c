"""``kvmove demo --processes N``: the prefill/decode shape, in N engine processes on one
Mooncake master.

Process 0 (prefill) writes ``--pages`` pages into its KV cache and evicts them to the
store. Processes 1..N-1 (decode) prefetch every one of them into their own caches and
verify each byte, and prefetch as many keys that were never stored, which must read
``MISS`` with their rows untouched. All processes use the same cache tables (geometry and
key prefix), so their keys agree. Each process is a :mod:`kvmove.cli.cluster_node`; the master
is an embedded one, or ``--master host:port``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

import kvmove
from kvmove.cli.cluster_node import NodeProcess
from kvmove.cli.node_logs import settle
from kvmove.store.embedded_master import tcp_reachable

BATCH = 64  # pages per command (each node's cache holds this many)


def _batches(pages: list[int]) -> list[list[int]]:
    return [pages[i:i + BATCH] for i in range(0, len(pages), BATCH)]


def _decode(node: NodeProcess, pages: list[int], unknown: list[int]) -> dict:
    """Prefetch ``pages`` (must be OK and exact) and ``unknown`` (must be MISS, untouched)."""
    known, missing = Counter(), Counter()
    wrong, touched, nbytes, seconds = [], [], 0, 0.0
    for batch in _batches(pages):
        r = node.call("prefetch", pages=batch)
        known.update(r["statuses"])
        wrong += r["wrong"]
        touched += r["touched"]
        nbytes += r["bytes"]
        seconds += r["seconds"]
    for batch in _batches(unknown):
        r = node.call("prefetch", pages=batch)
        missing.update(r["statuses"])
        wrong += r["wrong"]
        touched += r["touched"]
    return {"known": known, "unknown": missing, "wrong": wrong, "touched": touched,
            "bytes": nbytes, "seconds": seconds}


def run_main(args, console: Console) -> int:
    verbose = getattr(args, "verbose", 0) > 0
    logs = Path(tempfile.mkdtemp(prefix="kvmove-demo-"))
    master = None
    nodes: list[NodeProcess] = []
    ok = False
    try:
        if args.master:
            address = args.master
            host, _, port = address.rpartition(":")
            if not tcp_reachable(host.strip("[]"), int(port), 5.0):
                console.print(f"[bold red]demo failed[/]: cannot reach the Mooncake master at "
                              f"{address} (no TCP connection within 5 s; is mooncake_master "
                              f"running there?)", soft_wrap=True)
                shutil.rmtree(logs, ignore_errors=True)
                return 1
        else:
            master = kvmove.EmbeddedMaster(keep_log=verbose)
            address = master.address
        console.print(f"[bold]master[/] {address}"
                      + (f" (embedded, pid {master.pid})" if master else ""))
        common = dict(replicas=args.replicas, layers=args.layers, page_tokens=args.page_tokens,
                      resident=BATCH, key_prefix=f"demo{args.seed}-{time.time_ns()}")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.processes) as pool:
            nodes = list(pool.map(
                lambda i: NodeProcess(address, log_path=None if verbose else logs / f"{i}.log",
                                      **common),
                range(args.processes)))
        pids = ", ".join(str(n.pid) for n in nodes)
        console.print(f"[bold]processes[/] {args.processes} (pids {pids}) in "
                      f"{time.perf_counter() - t0:.1f} s; {args.layers} layers, "
                      f"{args.page_tokens}-token pages, "
                      f"{args.replicas} replica(s)")
        pages = list(range(args.pages))
        unknown = list(range(args.pages, args.pages + min(args.pages, BATCH)))
        t0 = time.perf_counter()
        put = Counter()
        for batch in _batches(pages):
            put.update(nodes[0].call("evict", pages=batch)["statuses"])
        evict_s = time.perf_counter() - t0
        with ThreadPoolExecutor(len(nodes) - 1) as pool:
            results = list(pool.map(lambda n: _decode(n, pages, unknown), nodes[1:]))
        ok = report(console, args, nodes, put, evict_s, results, pages, unknown)
    except (kvmove.StoreError, RuntimeError, TimeoutError) as e:
        # One line: the cause. The processes' logs (named below) hold the rest.
        console.print(f"[bold red]demo failed[/]: {str(e).splitlines()[0]}", soft_wrap=True)
        ok = False
    finally:
        codes = [n.close() for n in nodes]
        if master is not None:
            master.stop()
        ok = settle(console, logs, codes, ok, verbose)
    return 0 if ok else 1


def report(console, args, nodes, put: Counter, evict_s: float, results, pages, unknown) -> bool:
    table = Table(title=f"kvmove demo: {args.processes} processes, one master", min_width=72)
    for col in ("process", "role", "pages", "statuses", "MiB verified", "seconds"):
        table.add_column(col, justify="left" if col in ("role", "statuses") else "right")
    table.add_row(f"0 (pid {nodes[0].pid})", "prefill: evict", str(len(pages)),
                  ", ".join(f"{k} {v}" for k, v in put.items()), "-", f"{evict_s:.2f}")
    good = put == Counter({"ok": len(pages)})
    problems = [] if good else [f"prefill evict statuses {dict(put)}"]
    for i, r in enumerate(results, 1):
        table.add_row(f"{i} (pid {nodes[i].pid})", "decode: prefetch", str(len(pages)),
                      ", ".join(f"{k} {v}" for k, v in r["known"].items()),
                      f"{r['bytes'] / 2**20:.1f}", f"{r['seconds']:.2f}")
        table.add_row("", "unknown keys", str(len(unknown)),
                      ", ".join(f"{k} {v}" for k, v in r["unknown"].items()), "-", "")
        if r["known"] != Counter({"ok": len(pages)}):
            problems.append(f"process {i}: prefetch statuses {dict(r['known'])}")
        if r["unknown"] != Counter({"miss": len(unknown)}):
            problems.append(f"process {i}: unknown keys read {dict(r['unknown'])}, not all miss")
        if r["wrong"]:
            problems.append(f"process {i}: pages with wrong bytes {r['wrong'][:10]}")
        if r["touched"]:
            problems.append(f"process {i}: rows written for pages not read {r['touched'][:10]}")
    console.print(table)
    if problems:
        console.print(f"[bold red]verification FAILED[/]: {len(problems)} problem(s)")
        for line in problems:
            console.print(f"  {line}")
        return False
    total = sum(r["bytes"] for r in results)
    console.print(f"[bold green]verified[/]: {len(pages)} pages evicted by process 0, "
                  f"prefetched by {len(results)} other process(es), {total / 2**20:.1f} MiB, "
                  f"every byte as evicted; {len(unknown)} unknown keys read MISS")
    return True
