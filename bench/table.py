"""The printed tables (rich): every kvmove figure next to its baselines from the same run,
as GB/s and as a ratio; then the ratio summary and the headline figures."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bench.speedup_goal import MET, marked
from bench.summary import (
    LABELS,
    cache_of,
    floor_counts,
    floor_figures,
    fmt_ratio,
    headlines,
    methods_of,
    ratio,
    ratio_stats,
)


def kernel_table(records: list[dict], direction: str, title: str) -> Table:
    rs = [r for r in records if r["direction"] == direction]
    base = methods_of(rs, "baseline")
    table = Table(title=title, title_justify="left")
    for col in ("cache", "row B", "tokens", "pages", "MiB", "method", "GB/s"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for b in base:
        table.add_column(f"vs {LABELS.get(b, b)}\n(its GB/s)", justify="right")
    for r in rs:
        for i, m in enumerate(methods_of([r], "kvmove")):
            cells = [cache_of(r), str(r["row_bytes"]), str(r["page_tokens"]), str(r["pages"]),
                     f"{r['bytes'] / 2**20:.1f}"] if i == 0 else ["", "", "", "", ""]
            cells += [LABELS.get(m, m), f"{r['methods'][m]['gbps']:.2f}"]
            for b in base:
                v = ratio(r, m, b)
                cells.append("-" if v is None else
                             f"{v:.2f}x ({r['methods'][b]['gbps']:.2f})")
            table.add_row(*cells, end_section=i == len(methods_of([r], "kvmove")) - 1)
    return table


def summary_table(records: list[dict]) -> Table:
    table = Table(title="ratios over all cases (kvmove GB/s / baseline GB/s)",
                  title_justify="left")
    for col in ("direction", "cache", "method", "against", "median", "min", "max", "cases"):
        table.add_column(col, justify="right" if col in ("median", "min", "max", "cases")
                         else "left")
    for s in ratio_stats(records):
        table.add_row(s.direction, s.cache, LABELS.get(s.method, s.method),
                      LABELS.get(s.baseline, s.baseline), fmt_ratio(s.median),
                      fmt_ratio(s.low), fmt_ratio(s.high), str(s.cases))
    return table


def floor_table(records: list[dict]) -> Table | None:
    """The torch floor (CPU): every shape where torch does not meet its goal against the
    primitive calls it makes or the plain per-layer index op (met ones are counted in the
    title), with the per-repeat ratios' median, quartiles and verdict, and the run's spread.
    None where the run has no torch figures."""
    figures = floor_figures(records)
    if not figures:
        return None
    counts = floor_counts(figures)
    table = Table(title=f"torch floor: baseline time / torch time per repeat, median "
                        f"(quartiles) against the goal; {counts['met']} met, "
                        f"{counts['within noise']} within noise, {counts['missed']} missed "
                        f"of {len(figures)} (only those not met are listed)",
                  title_justify="left")
    for col in ("shape", "against", "goal", "ratio", "spread"):
        table.add_column(col, justify="left" if col in ("shape", "against") else "right")
    for f in figures:
        if f.verdict == MET:
            continue
        table.add_row(f.shape(), LABELS.get(f.baseline, f.baseline), f"{f.goal:g}x",
                      marked(f.figure), "-" if f.spread is None else f"{f.spread:.2f}")
    return table


def print_all(data: dict, console: Console | None = None) -> None:
    console = console or Console()
    records = data["kernels"]
    who = data["machine"]["title"]
    for direction, arrow in (("gather", "KV -> staging"), ("scatter", "staging -> KV")):
        if any(r["direction"] == direction for r in records):
            console.print(kernel_table(records, direction, f"{direction} ({arrow}) on {who}"))
    if records:
        console.print(summary_table(records))
        floor = floor_table(records)
        if floor is not None:
            console.print(floor)
    for h in headlines(data):
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: ""}[h.met]
        target = f" (target >= {h.target:g}x) {mark}" if h.target is not None else ""
        console.print(f"  {h.text}: [bold]{fmt_ratio(h.value)}[/]{target}")
