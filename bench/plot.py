"""The plot: GB/s against row size, one line per method, one panel per (direction, cache,
page size), at the largest page count of each point; the bulk copy (the ceiling) drawn as a
dashed line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.results import load
from bench.summary import LABELS, cache_of, caches_of, largest_cases, methods_of

STYLE = {"bulk": {"color": "black", "linestyle": "--", "linewidth": 2, "marker": None}}


def plot(data: dict, path: Path) -> Path:
    records = largest_cases(data["kernels"])
    panel_rows = [(d, c) for d in ("gather", "scatter") for c in caches_of(records)
                  if any(r["direction"] == d and cache_of(r) == c for r in records)]
    tokens = sorted({r["page_tokens"] for r in records})
    fig, axes = plt.subplots(len(panel_rows), len(tokens), squeeze=False, sharey=True,
                             figsize=(4.2 * len(tokens), 3.6 * len(panel_rows)))
    methods = methods_of(records, "kvmove") + methods_of(records, "baseline")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {m: STYLE.get(m, {"marker": "o", "color": colors[k % len(colors)]})
              for k, m in enumerate(methods)}  # one colour per method in every panel
    legend: dict[str, object] = {}
    for i, (d, cache) in enumerate(panel_rows):
        for j, pt in enumerate(tokens):
            ax = axes[i][j]
            rs = sorted((r for r in records if r["direction"] == d and cache_of(r) == cache
                         and r["page_tokens"] == pt), key=lambda r: r["row_bytes"])
            for m in methods:
                pts = [(r["row_bytes"], r["methods"][m]["gbps"]) for r in rs if m in r["methods"]]
                if pts:
                    x, y = zip(*pts, strict=True)
                    [line] = ax.plot(x, y, label=LABELS.get(m, m), **styles[m])
                    legend.setdefault(m, line)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks([r["row_bytes"] for r in rs], [str(r["row_bytes"]) for r in rs])
            ax.set_title(f"{d}, {cache.replace('_', '-')} cache, {pt}-token pages", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(panel_rows) - 1:
                ax.set_xlabel("row bytes")
            if j == 0:
                ax.set_ylabel("GB/s")
    shown = [m for m in methods if m in legend]  # every method of any panel, in order
    fig.legend([legend[m] for m in shown], [LABELS.get(m, m) for m in shown],
               loc="lower center", ncol=min(len(shown), 5), fontsize=9)
    machine = data["machine"]["title"]
    layers = data["settings"]["layers"]
    fig.suptitle(f"kvmove row copies on {machine} ({layers} layers; median GB/s)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__)
    parser.add_argument("results", type=Path, help="a results file (RESULTS_DIR/*.json)")
    args = parser.parse_args(argv)
    print(plot(load(args.results), args.results.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
