"""``kvmove demo --processes N --direct``: prefill -> decode host memory, directly.

Process 0 (prefill) computes ``--pages`` pages of a synthetic DSA-like cache (656-byte KV
rows, 132-byte indexer rows), request by request, layer by layer, and streams each layer,
as soon as it is computed, straight into the layer-first host pools of processes 1..N-1
(decode) with a :class:`kvmove.PageSender` (``send(..., layers=l)``, waited for once at the
end of the request). Each decode process opened its pool as a :class:`kvmove.PageReceiver`
and handed its handle over (here: through the demo's own pipes, standing in for an
engine's bootstrap channel); it places each request's pages in a run of its pool, and at
the end checks every byte: the pages sent hold exactly their rows, the padding rows of
the partial last page and every page never sent still hold the sentinel. No store, no
master: one network hop. Each process is a :mod:`kvmove.cli.direct_node`.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmove.cli.direct_node import Node
from kvmove.cli.node_logs import settle

REQUEST_PAGES = 64  # pages of one prefill request


def _requests(pages: int) -> list[list[int]]:
    return [list(range(i, min(pages, i + REQUEST_PAGES))) for i in range(0, pages, REQUEST_PAGES)]


def run_main(args, console: Console) -> int:
    verbose = getattr(args, "verbose", 0) > 0
    logs = Path(tempfile.mkdtemp(prefix="kvmove-demo-direct-"))
    indexer = args.layers if args.indexer_layers is None else args.indexer_layers
    common = {"layers": args.layers, "indexer_layers": indexer, "page_tokens": args.page_tokens}
    p = args.page_tokens
    nodes: list[Node] = []
    ok = False
    try:
        t0 = time.perf_counter()
        nodes = [Node("prefill", None if verbose else logs / "0-prefill.log",
                      {**common, "pages": min(args.pages, REQUEST_PAGES),
                       "backend": args.backend})]
        nodes += [Node("decode", None if verbose else logs / f"{i}-decode.log",
                       {**common, "pages": args.pages}) for i in range(1, args.processes)]
        for node in nodes:
            node.wait_ready()
        console.print(f"[bold]processes[/] {args.processes} (pids "
                      f"{', '.join(str(n.pid) for n in nodes)}) in "
                      f"{time.perf_counter() - t0:.1f} s; {args.layers} layers "
                      f"(indexer {indexer}), {p}-token pages; no store: prefill writes into "
                      f"the decode pools directly")
        decoders = nodes[1:]
        handles = [n.handle for n in decoders]
        # The last page of the sequence is partial (its padding rows must stay untouched).
        valid = {page: p for page in range(args.pages)}
        valid[args.pages - 1] = max(1, p - 3)
        # Each decode pool takes the sequence in a run that starts a third of the way in
        # (and wraps around): consecutive pages, consecutive destinations.
        shift = args.pages // 3
        dst = {page: (page + shift) % args.pages for page in range(args.pages)}
        sent, seconds, nbytes = Counter(), 0.0, 0
        for request in _requests(args.pages):
            r = nodes[0].call("prefill", handles=handles, pages=request,
                              dst=[[dst[page] for page in request]] * len(decoders),
                              valid=[valid[page] for page in request])
            sent.update(r["statuses"])
            seconds += r["seconds"]
            nbytes += r["bytes"]
        pages = list(range(args.pages))
        with ThreadPoolExecutor(len(decoders)) as pool:
            checks = list(pool.map(lambda n: n.call(
                "verify", pages=pages, dst=[dst[x] for x in pages],
                valid=[valid[x] for x in pages]), decoders))
        ok = report(console, args, nodes, sent, seconds, nbytes, checks)
    except (RuntimeError, TimeoutError) as e:
        console.print(f"[bold red]demo failed[/]: {e}")
        ok = False
    finally:
        ok = settle(console, logs, [n.close() for n in nodes], ok, verbose)
    return 0 if ok else 1


def report(console, args, nodes, sent: Counter, seconds: float, nbytes: int, checks) -> bool:
    layers = max(args.layers, args.indexer_layers or 0)
    table = Table(title=f"kvmove demo --direct: {args.processes} processes, no store",
                  min_width=72)
    for col in ("process", "role", "pages", "statuses", "MiB", "seconds", "GB/s"):
        table.add_column(col, justify="left" if col in ("role", "statuses") else "right")
    table.add_row(f"0 (pid {nodes[0].pid})", "prefill: send layer by layer",
                  str(args.pages * (len(nodes) - 1)), ", ".join(f"{k} {v}"
                                                                 for k, v in sent.items()),
                  f"{nbytes / 2**20:.1f}", f"{seconds:.2f}",
                  f"{nbytes / seconds / 1e9:.2f}" if seconds else "-")
    problems = []
    sends = args.pages * (len(nodes) - 1) * layers
    if sent != Counter({"ok": sends}):
        problems.append(f"prefill: page sends {dict(sent)}, expected {sends} ok")
    for i, c in enumerate(checks, 1):
        table.add_row(f"{i} (pid {nodes[i].pid})", "decode: check pool", str(args.pages),
                      "wrong " + str(len(c["wrong"])) + ", touched " + str(len(c["touched"])),
                      f"{c['bytes'] / 2**20:.1f}", "", "")
        if c["wrong"]:
            problems.append(f"process {i}: pages with wrong bytes {c['wrong'][:10]}")
        if c["touched"]:
            problems.append(f"process {i}: rows written that no send names "
                            f"{c['touched'][:10]}")
    console.print(table)
    total = sum(c["bytes"] for c in checks)
    console.print(
        f"[bold green]verified[/]: {args.pages} pages streamed layer by layer by process 0 "
        f"into {len(checks)} decode pool(s), {total / 2**20:.1f} MiB, every byte as sent, "
        "padding and unsent pages untouched" if not problems else
        f"[bold red]verification FAILED[/]: {'; '.join(problems)}")
    return not problems
