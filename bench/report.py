"""The README's performance section, in markdown, generated from a results file (never
typed by hand): ``python -m bench.report bench/results/<machine>-<date>.json``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results import load
from bench.summary import LABELS, PRIMITIVE, fmt_ratio, headlines, largest_cases, methods_of, ratio


def _machine_line(m: dict) -> str:
    parts = [m["title"]]
    if m.get("gpu"):
        parts.append(f"CPU {m['cpu']}, {m['cores']} cores")
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB RAM")
    parts.append(f"torch {m['torch']}")
    if m.get("triton"):
        parts.append(f"Triton {m['triton']}")
    if m.get("cuda"):
        parts.append(f"CUDA {m['cuda']}")
    return ", ".join(parts)


def direction_table(records: list[dict], direction: str) -> list[str]:
    rs = [r for r in largest_cases(records) if r["direction"] == direction]
    mine = methods_of(rs, "kvmove")
    base = methods_of(rs, "baseline")
    if not rs or not mine:
        return []
    primary = mine[0]
    head = ["row B", "tokens", "pages", *(f"{LABELS[m]} GB/s" for m in mine),
            *(f"{LABELS.get(b, b)} GB/s" for b in base),
            *(f"{LABELS[primary]} / {LABELS.get(b, b)}" for b in base)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rs:
        row = [str(r["row_bytes"]), str(r["page_tokens"]), str(r["pages"])]
        row += [f"{r['methods'][m]['gbps']:.2f}" if m in r["methods"] else "-" for m in mine]
        row += [f"{r['methods'][b]['gbps']:.2f}" if b in r["methods"] else "-" for b in base]
        row += [fmt_ratio(ratio(r, primary, b)) for b in base]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown(data: dict, source: str | None = None) -> str:
    m, s = data["machine"], data["settings"]
    records = data["kernels"]
    date = data["created"][:10]
    out = [f"### Performance on {m['title']}", ""]
    out.append(f"Measured on {date} with `{data['command']}`"
               + (f" (results: `{source}`)" if source else "") + f": {_machine_line(m)}.")
    out.append(f"{s['layers']} layers; every figure is the median of {s['repeats']} "
               f"interleaved repeats after {s['warmup']} warm-up run(s); GB/s counts the bytes "
               "moved once (rows x row bytes x layers). Ratios compare with baselines timed "
               "in the same run, on the same data. Each row is the largest page count "
               "measured for that shape.")
    if not m.get("gpu"):
        out.append(f"The torch primitive is a plain per-layer `{PRIMITIVE['gather']}` into "
                   f"the staging view (gather) or `{PRIMITIVE['scatter']}` from it (scatter); "
                   "memcpy per page/row are `ctypes.memmove` loops.")
    else:
        out.append("memcpy per page/row are `cudaMemcpyAsync` loops to or from pinned host "
                   "memory; CPU rearrange is a bulk copy of the touched KV to pinned host "
                   "memory followed by a CPU gather into the staging layout.")
    out.append("")
    for direction, arrow in (("gather", "KV → staging"), ("scatter", "staging → KV")):
        lines = direction_table(records, direction)
        if lines:
            out += [f"**{direction}** ({arrow})", "", *lines, ""]
    heads = headlines(data)
    if heads:
        out += ["Headline figures from this run (targets are goals, not test assertions):", ""]
        for h in heads:
            target = ""
            if h.target is not None:
                target = f" — target ≥ {h.target:g}x, {'met' if h.met else 'missed'}"
            out.append(f"- {h.text}: **{fmt_ratio(h.value)}**{target}")
        out.append("")
    for suite in data.get("suites", {}).values():
        if isinstance(suite, dict) and suite.get("markdown"):
            out += [suite["markdown"].rstrip(), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", type=Path, help="a bench/results/*.json file")
    args = parser.parse_args(argv)
    print(markdown(load(args.results), source=str(args.results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
