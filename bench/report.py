"""The performance page, in markdown, generated from a results file (never typed by hand):
``python -m bench.report RESULTS_DIR/<machine>-<date>.json --out docs/PERFORMANCE.md
--readme README.md`` (``bench.results.RESULTS_DIR``) writes ``docs/PERFORMANCE.md`` (every
table, and where kvmove falls short of a goal by more than the run's own spread, stated
plainly; its hand-written "Findings" section is kept) and the README's few headline figures.
Paths on the page are relative to the repository."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.bench_in_place import SUMMARY_COLUMNS, summary_rows
from bench.results import load
from bench.speedup_goal import MET, MISSED, cell
from bench.summary import (
    FLOOR_AS_CALLED,
    FLOOR_PLAIN,
    LABELS,
    PRIMITIVE,
    cache_of,
    floor_counts,
    floor_figures,
    fmt_ratio,
    headlines,
    largest_cases,
    methods_of,
    ratio,
    ratio_noise,
    short_of,
)


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
    if m.get("omp_wait_policy"):
        parts.append(f"OMP_WAIT_POLICY={m['omp_wait_policy']}")
    return ", ".join(parts)


def direction_table(records: list[dict], direction: str) -> list[str]:
    rs = [r for r in largest_cases(records) if r["direction"] == direction]
    mine = methods_of(rs, "kvmove")
    base = methods_of(rs, "baseline")
    if not rs or not mine:
        return []
    primary = mine[0]
    head = ["cache", "row B", "tokens", "pages", *(f"{LABELS[m]} GB/s" for m in mine),
            *(f"{LABELS.get(b, b)} GB/s" for b in base),
            *(f"{LABELS[primary]} / {LABELS.get(b, b)}" for b in base)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rs:
        row = [cache_of(r), str(r["row_bytes"]), str(r["page_tokens"]), str(r["pages"])]
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
        out.append(f"The torch primitive is a plain per-layer `{PRIMITIVE['gather']}` of the "
                   f"token rows into the staging view (gather) or `{PRIMITIVE['scatter']}` "
                   "from it (scatter). The torch backend moves whole aligned pages in units "
                   "of up to 16 KiB, copies in 16-byte words where aligned and moves a run "
                   "into a run with one memmove per layer; \"primitive as called\" times "
                   "exactly those calls, made plainly, so kvmove over it is its own cost. "
                   "memcpy per page/row are `ctypes.memmove` loops. Caches are given as one "
                   "stacked tensor or as per-layer tensors (one allocation per layer, as "
                   "SGLang's device pools).")
    else:
        out.append("memcpy per page/row are `cudaMemcpyAsync` loops to or from pinned host "
                   "memory; CPU rearrange is a bulk copy of the touched KV to pinned host "
                   "memory followed by a CPU gather into the staging layout.")
    out.append("")
    for direction, arrow in (("gather", "KV → staging"), ("scatter", "staging → KV")):
        lines = direction_table(records, direction)
        if lines:
            out += [f"**{direction}** ({arrow})", "", *lines, ""]
    out += floor_section(records)
    heads = headlines(data)
    if heads:
        out += ["Headline figures from this run (targets are goals, not test assertions):", ""]
        for h in heads:
            target = ""
            if h.target is not None:
                target = f" — target ≥ {h.target:g}x, {'met' if h.met else 'missed'}"
            out.append(f"- {h.text}: **{fmt_ratio(h.value)}**{target}")
        out.append("")
    for name, suite in data.get("suites", {}).items():
        out += suite_section(name, suite)
    return "\n".join(out)


def floor_section(records: list[dict]) -> list[str]:
    """The torch floor (CPU runs): the verdict counts, and every shape not met with its
    figure, quartiles and the run's spread (markdown lines; none without torch figures)."""
    figures = floor_figures(records)
    if not figures:
        return []
    counts = floor_counts(figures)
    out = [f"**The torch floor**: the torch backend against the primitive calls it makes, "
           f"made plainly (goal ≥ {FLOOR_AS_CALLED:g}x), and against a plain per-layer "
           f"`{PRIMITIVE['gather']}` / `{PRIMITIVE['scatter']}` (goal ≥ {FLOOR_PLAIN:g}x), "
           "at every case of the run: the baseline's time over torch's in each repeat, "
           "median (quartiles); met when the lower quartile reaches the goal, missed when the "
           f"upper one falls short. {counts['met']} met, {counts['within noise']} within "
           f"noise, {counts['missed']} missed of {len(figures)}.", ""]
    rest = [f for f in figures if f.verdict != MET]
    if rest:
        out += ["| shape | against | goal | ratio (quartiles) and verdict | spread |",
                "|---|---|---:|---:|---:|"]
        out += [f"| {f.shape()} | {LABELS.get(f.baseline, f.baseline)} | {f.goal:g}x | "
                f"{cell(f.figure)} | {'-' if f.spread is None else f'{f.spread:.2f}'} |"
                for f in rest]
        out.append("")
    return out


def _gbps_table(figures: dict[str, float]) -> list[str]:
    return ["| path | GB/s (median) |", "|---|---:|",
            *(f"| {k} | {v:.2f} |" for k, v in figures.items()), ""]


def suite_section(name: str, suite: dict) -> list[str]:
    """The markdown of an optional suite's results (``bench_store``, ``bench_mover``)."""
    if not isinstance(suite, dict):
        return []
    if suite.get("benchmark") == "bench_gpu" or (name == "gpu" and "skipped" in suite):
        from bench.bench_gpu import markdown

        return markdown(suite)
    if "skipped" in suite or "failed" in suite:
        return [f"*{name} suite: {suite.get('skipped') or suite.get('failed')}*", ""]
    command = re.sub(r" --json \S+", "", suite.get("command", ""))
    out = [f"**{name}** (`{command}`)" if command else f"**{name}**", ""]
    if suite.get("benchmark") == "bench_sglang":
        out += ["SGLang storage backend: kvmove's `KVMoveStorage` against SGLang's own "
                f"Mooncake backend (SGLang {suite.get('sglang')}), same pages, same store:", "",
                "| descriptors | pages x layers | SGLang ms | kvmove ms | kvmove faster |",
                "|---|---:|---:|---:|---:|"]
        out += [f"| {d['layout']} ({d['spans_per_key']} spans/key) | {d['pages']} x "
                f"{d['layers']} | {d['median_s']['sglang'] * 1e3:.1f} | "
                f"{d['median_s']['kvmove'] * 1e3:.1f} | {d['speedup']:.2f}x |"
                for d in suite.get("describe", [])]
        out += ["", "| batch_set_v1 / batch_get_v1 | pages x tokens | set (kvmove / SGLang) "
                "| get (kvmove / SGLang) |", "|---|---:|---:|---:|"]
        for e in suite.get("end_to_end", []):
            what = f"| {e['layout']} | {e['pages']} x {e['page_size']} |"
            out.append(f"{what} {e['failed']} | |" if "failed" in e else
                       f"{what} {e['speedup_set']:.2f}x | {e['speedup_get']:.2f}x |")
        out.append("")
        return out
    if suite.get("benchmark") == "bench_direct":
        return out + direct_section(suite)
    if suite.get("benchmark") == "bench_checksum":
        out += [f"The checksum's cost: KVMover evict + prefetch with `checksum=True` over the "
                f"staged mover without it (goal <= {suite['goal']:g}x), and the checksum "
                f"alone as a share of the staged round trip:", "",
                "| cache | page tokens | pages x layers | with / without | paired range | "
                "checksum alone | met |", "|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {c['cache']} | {c['page_tokens']} | {c['pages']} x {c['layers']} | "
                f"{c['ratio']:.2f}x | {c['paired_ratio_range'][0]:.2f}-"
                f"{c['paired_ratio_range'][1]:.2f} | {c['alone_share'] * 100:.0f}% | "
                f"{'yes' if c['met'] else 'no'} |" for c in suite.get("cases", [])]
        out.append("")
        return out
    if suite.get("benchmark") == "bench_metrics_cost":
        out += [f"Metrics off against on: host time of one call ({suite['layers']} layers x "
                f"{suite['row_bytes']} B, {suite['pages']} pages of {suite['page_tokens']} "
                f"tokens; medians of {suite['rounds']} interleaved rounds):", "",
                "| call | off µs | on µs | added µs (quartiles) | goal | met | resolved |",
                "|---|---:|---:|---:|---:|---|---|"]
        out += [f"| {r['op']} | {r['off_us']:.1f} | {r['on_us']:.1f} | {r['added_us']:+.2f} "
                f"({r['added_q1_us']:+.1f} .. {r['added_q3_us']:+.1f}) | +{r['goal_us']:g} | "
                f"{'yes' if r['met'] else 'no'} | {'yes' if r['resolved'] else 'no: noise'} |"
                for r in suite.get("rows", [])]
        out.append("")
        return out
    d = suite.get("describe")
    if d:
        out += [f"- descriptors for {d['keys']} keys x {d['layers']} layers ({d['spans']} "
                f"spans): `describe` is {d['median_speedup_vs_loop']:.1f}x faster than the "
                f"per-(page, layer) loop and {d['median_ratio_to_floor']:.2f}x the floor "
                "(the `tolist()` of the finished pointer array), medians", ""]
    t = suite.get("transfer")
    if t:
        out += [f"Store put/get of {t['keys']} objects of {t['object_bytes'] / 2**20:.2f} MiB "
                f"({t['layers']} spans each) against raw contiguous puts/gets:", ""]
        out += _gbps_table(t["median_GBps"])
        out += [f"- put {t['put_ratio']:.2f}x raw, get {t['get_ratio']:.2f}x raw (best of "
                "repeats)", ""]
    if "calls" in suite:
        out += [f"One call of a few pages, back to back ({suite['device']}, {suite['layers']} "
                f"layers, {suite['row_bytes']}-byte rows), against {suite['plain']}:", "",
                "| direction | cache | page tokens | pages | kvmove µs | unchecked µs | plain µs |",
                "|---|---|---:|---:|---:|---:|---:|"]
        out += [f"| {c['direction']} | {c.get('cache', 'stacked')} | {c['page_tokens']} | "
                f"{c['pages']} | {c['kvmove_us']:.0f} "
                f"| {c['kvmove_unchecked_us']:.0f} | {c['plain_us']:.0f} |" for c in suite["calls"]]
        out += ["", *(f"- {what.replace('_', ' ')}: kvmove adds {us:.0f} µs per call (median)"
                      for what, us in suite["median_added_us"].items())]
        hot = suite.get("hot_path")
        if hot:
            out += ["", "The hot path of a decode step (targets are goals, not test assertions):",
                    "", "| figure | value | target | met |", "|---|---:|---:|---|"]
            out += [f"| {_hot_name(k)} | {f['value']:.2f} | {f['target']:g} | "
                    f"{'yes' if f['met'] else 'no'} |" for k, f in hot["targets"].items()]
            if "busy" in hot:
                b = hot["busy"]
                out.append(f"- with {b['busy_processes']} busy processes: gather "
                           f"{b['gather_GBps']:.2f} GB/s, per-row memmove loop "
                           f"{b['memmove_loop_GBps']:.2f} GB/s")
        if suite["device"] == "cpu" and suite.get("omp_wait_policy") == "PASSIVE":
            out.append("- with OpenMP threads waiting passively (as in this run), every "
                       "parallel torch call pays a wake-up; torch's default (spinning) "
                       "workers make small copies cheaper on both sides")
        out.append("")
    ws = [w for w in suite.get("in_place", []) if "verdict" in w]  # (older runs: JSON only)
    if ws:
        out += [f"KVMover on a host-memory cache against the in-place floor (the raw client "
                f"reading and writing the KV rows in place, same client and store); block "
                f"rows of {ws[0]['row_bytes']} B and token rows, stacked and per-layer caches; "
                f"median of paired ratios over {ws[0]['repeats']} repeats, quartiles, and "
                f"the verdict (met: upper quartile within the goal; missed: lower quartile "
                f"above it; else within noise)"
                + (f", {ws[0]['settle_s'] * 1e3:g} ms asleep before each call"
                   if ws[0].get("settle_s") else "") + ":", "",
                "| " + " | ".join(SUMMARY_COLUMNS) + " |",
                "|" + "---|" * len(SUMMARY_COLUMNS)]
        out += ["| " + " | ".join(summary_rows(w)) + " |" for w in ws]
        out.append("")
    v = suite.get("vllm")
    if v:
        out += [f"vLLM connector save/load of {v['blocks']} blocks of "
                f"{v['object_bytes'] / 1024:.0f} KiB, kvmove's connector path against vLLM's "
                "MooncakeStoreConnector path on the same KV tensors:", ""]
        out += ["| path | ms (median) | GB/s |", "|---|---:|---:|"]
        for k, sec in v["median_s"].items():  # "... returns": the caller's wait, no bytes
            gbps = "-" if k.endswith("returns") else f"{v['median_GBps'][k]:.2f}"
            out.append(f"| {k} | {sec * 1e3:.2f} | {gbps} |")
        out.append("")
        new_blocks = "; kvmove's save of new blocks, without the exists query" \
            if "save_ratio_exists_query" in v else ""
        out += [f"- kvmove / vLLM (time ratio, > 1 = kvmove faster; vLLM's calls on its "
                f"transfer thread, as its connector makes them{new_blocks}): save "
                f"{v['save_ratio']:.2f}x, load {v['load_ratio']:.2f}x"]
        if "load_ratio_in_step" in v:
            out.append(f"- kvmove's load inside the step (the connector with `load_async` "
                       f"off): {v['load_ratio_in_step']:.2f}x")
        if "save_ratio_exists_query" in v:
            q = v["paired_ratio_exists_query"]
            out.append(f"- kvmove's save with the exists query first (blocks not known to be "
                       f"new): {v['save_ratio_exists_query']:.2f}x, paired {q['median']:.2f}x "
                       f"({q['q1']:.2f}-{q['q3']:.2f})")
        if "inline_ratio" in v:
            out.append(f"- against vLLM's calls made inline on the caller's thread (no "
                       f"thread, which no vLLM configuration does): save "
                       f"{v['inline_ratio']['save']:.2f}x, load "
                       f"{v['inline_ratio']['load']:.2f}x")
        if "paired_ratio" in v:
            out.append("- per repeat (median of paired ratios, quartiles): " + ", ".join(
                f"{op} {p['median']:.2f}x ({p['q1']:.2f}-{p['q3']:.2f})"
                for op, p in v["paired_ratio"].items()))
        if "kvmove_path" in v:
            p = v["kvmove_path"]
            out.append(f"- kvmove's path: save {p['save']}, load {p['load']} ({p['why']})")
        out.append("")
    if "median_GBps" in suite:
        what = ", ".join(f"{k} {suite[k]}" for k in ("device", "layers", "page_tokens", "pages")
                         if k in suite)
        out += [f"End to end ({what}):", "", *_gbps_table(suite["median_GBps"])]
        out += [f"- {k}: {v:.2f}x" for k, v in suite.get("ratios", {}).items()] + [""]
    return out


def direct_section(suite: dict) -> list[str]:
    """The prefill -> decode host pool suite (``bench_direct``)."""
    out = [f"Prefill -> decode host pool, {suite['layers']} layers x {suite['page_tokens']} "
           f"tokens x {suite['row_bytes']} B pages into another process's layer-first pool "
           "(TCP on loopback): `PageSender.send` against evict into the store + get into the "
           f"pool, medians of {suite['repeats']} interleaved repeats:", "",
           "| path | ms | GB/s |", "|---|---:|---:|"]
    out += [f"| {k} | {v * 1e3:.1f} | {suite['median_GBps'][k]:.2f} |"
            for k, v in suite["median_s"].items()]
    out += ["", *(f"- {k}: {v:.2f}x" for k, v in suite["ratios"].items())]
    out += [f"- one layer's send returns after {us:.0f} µs ({n} pages; the write goes on in "
            "the background)" for n, us in suite.get("layer_send_returns_us", {}).items()]
    return [*out, ""]


_HOT_NAMES = {
    "one_page_gather": "one-page gather / plain per-layer index_select (x)",
    "one_page_scatter": "one-page scatter / plain per-layer index_copy_ (x)",
    "prefetch_return_us": "KVMover.prefetch returns, 32 keys x 61 layers (µs)",
    "layerwise_over_whole": "layer-wise / whole-cache prefetch, same keys (x)",
    "busy_gather_over_memmove_loop": "gather / per-row memmove loop, every core busy (x)",
}



def _hot_name(key: str) -> str:
    """The words of a hot-path figure named ``"<cache>: <figure>"`` (or ``"<figure>"``)."""
    cache, _, figure = key.rpartition(": ")
    name = _HOT_NAMES.get(figure, figure)
    return f"{cache.replace('_', '-')} cache: {name}" if cache else name


BEGIN, END = "<!-- bench-report:begin -->", "<!-- bench-report:end -->"
# Baselines kvmove must not be slower than (a bulk copy of contiguous bytes is a ceiling,
# not a peer, and is reported against its own targets instead).
PEERS = ("primitive", "primitive_units", "memcpy_page", "memcpy_row", "cpu_rearrange")


def _spread_of(spread: dict, *names: str) -> float | None:
    """Half the sum of the recorded spreads of two timed figures (None where one is missing)."""
    found = [spread[n] for n in names if n in spread]
    return sum(found) / 2 if len(found) == len(names) else None


def _noted(noise: float | None) -> str:
    return f" (spread {noise * 100:.0f}%)" if noise is not None else " (no spread recorded)"


def behind(data: dict) -> list[str]:
    """Every comparison in the run where kvmove falls short of its goal (a peer's figure, a
    target) by more than the run's own spread, as markdown bullets (empty when there is
    none). A shortfall within the spread is noise, and is not listed."""
    out = []
    floor = floor_figures(data.get("kernels", []))
    # The torch floor judges torch against the primitives by its own goals (below): not
    # here again against 1.0.
    peers = [b for b in PEERS if not floor or b not in ("primitive", "primitive_units")]
    for r in largest_cases(data.get("kernels", [])):
        mine = methods_of([r], "kvmove")
        if not mine:
            continue
        for base in peers:
            value = ratio(r, mine[0], base)
            noise = ratio_noise(r, mine[0], base)
            if short_of(value, 1.0, noise):
                out.append(f"- {r['direction']} of {r['row_bytes']}-byte rows, "
                           f"{r['page_tokens']}-token pages, {r['pages']} pages, "
                           f"{cache_of(r).replace('_', '-')} cache: {LABELS[mine[0]]} at "
                           f"{fmt_ratio(value)} of {LABELS.get(base, base)}{_noted(noise)}")
    for f in floor:
        if f.verdict == MISSED:
            out.append(f"- torch floor, {f.shape()}: {cell(f.figure)} against "
                       f"{LABELS.get(f.baseline, f.baseline)}, goal ≥ {f.goal:g}x")
    for h in headlines(data):
        if h.behind:
            out.append(f"- {h.text}: {fmt_ratio(h.value)}, target {h.target:g}x"
                       f"{_noted(h.noise)}")
    for name, suite in data.get("suites", {}).items():
        if not isinstance(suite, dict):
            continue
        v = suite.get("vllm")
        for what in ("save", "load"):
            noise = v and _spread_of(v.get("spread", {}), f"kvmove {what}", f"vLLM {what}")
            if v and short_of(v.get(f"{what}_ratio"), 1.0, noise):
                out.append(f"- vLLM connector {what}: {v[f'{what}_ratio']:.2f}x vLLM's own "
                           f"connector path ({name} suite){_noted(noise)}")
        for d in suite.get("describe", []) if isinstance(suite.get("describe"), list) else []:
            noise = _spread_of(d.get("spread", {}), "kvmove", "sglang")
            if short_of(d.get("speedup"), 1.0, noise):
                out.append(f"- SGLang {d['layout']} descriptors, {d['pages']} pages: "
                           f"{d['speedup']:.2f}x SGLang's own{_noted(noise)}")
        for e in suite.get("end_to_end", []):
            for what in ("set", "get"):
                value = e.get(f"speedup_{what}")
                noise = _spread_of(e.get("spread", {}), f"kvmove {what}", f"sglang {what}")
                if short_of(value, 1.0, noise):
                    out.append(f"- SGLang batch_{what}_v1, {e['layout']}, {e['pages']} x "
                               f"{e['page_size']}: {value:.2f}x SGLang's own backend"
                               f"{_noted(noise)}")
        for w in suite.get("in_place", []):
            for op, said in w.get("verdict", {}).items():
                if said == "missed":
                    q = w["over_floor_quartiles"][f"auto {op}"]
                    out.append(f"- KVMover {op} of {w['workload']}, {w['cache']} cache, "
                               f"{w['pages']} pages: {w['over_floor'][f'auto {op}']:.2f}x the "
                               f"in-place floor (quartiles {q[0]:.2f}-{q[1]:.2f}), goal "
                               f"<= {w['target']:g}x")
        for f in (suite.get("hot_path") or {}).get("targets", {}).values():
            if f.get("met") is False:  # targets of either sense; the suite records no spread
                out.append(f"- hot path: {f.get('text', '')} {f['value']:.2f} (target "
                           f"{f['target']:g})".replace("hot path:  ", "hot path: "))
    return out


FINDINGS = "## Findings"
ROOT = Path(__file__).resolve().parents[1]


def page(data: dict, source: str | None = None, findings: str = "") -> str:
    """The whole ``docs/PERFORMANCE.md``; ``findings`` (the page's hand-written "Findings"
    section, kept from the page it replaces) goes at its end."""
    short = behind(data)
    parts = ["# kvmove performance", "",
             "Generated by `python -m bench.report` from one `make bench` results file; every "
             "ratio compares kvmove with a baseline timed in the same run, on the same data, "
             "interleaved. Reproduce with `make bench`.", "",
             "## Where kvmove is behind", "",
             "Each comparison where kvmove falls short of its goal by more than the run's own "
             "spread (half the sum of the two figures' (max - min) / median over the repeats); "
             "a shortfall inside the spread is noise and is not listed. The torch floor's "
             "figures are judged by the quartiles of their per-repeat ratios instead: those "
             "listed missed (the upper quartile short of the goal).", ""]
    parts += short or ["- nowhere in this run: no kvmove figure is short of its goal by more "
                      "than the run's spread."]
    parts += ["", markdown(data, source)]
    text = "\n".join(parts).rstrip() + "\n"
    return text + ("\n" + findings.strip() + "\n" if findings.strip() else "")


def findings_of(text: str) -> str:
    """The "Findings" section of a page (to its end), or nothing."""
    at = text.find("\n" + FINDINGS + "\n")
    return text[at + 1:] if at >= 0 else ""


def relative(path: Path) -> str:
    """``path`` as the page names it: relative to the repository (never a path of the machine
    the report ran on)."""
    full = Path(path).resolve()
    try:
        return full.relative_to(ROOT).as_posix()
    except ValueError:
        return Path(path).as_posix() if not Path(path).is_absolute() else Path(path).name


def readme_block(data: dict, source: str | None = None) -> str:
    """The README's few headline figures (the page has the rest)."""
    m = data["machine"]
    lines = [f"Measured {data['created'][:10]} on {m['title']} (`make bench`; every figure "
             "against a baseline timed in the same run):", ""]
    lines += [f"- {h.text}: **{fmt_ratio(h.value)}**" for h in headlines(data)[:5]]
    short = behind(data)
    lines += ["", f"All tables, and the {len(short)} comparison(s) where kvmove is behind by "
              "more than the run's spread, in [docs/PERFORMANCE.md](docs/PERFORMANCE.md)."
              if short else
              "All tables in [docs/PERFORMANCE.md](docs/PERFORMANCE.md)."]
    return "\n".join(lines)


def write_into(readme: Path, section: str) -> None:
    """Replace what stands between the README's report markers with ``section``."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{section.strip()}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", type=Path, help="a results file (RESULTS_DIR/*.json)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the whole page here (e.g. docs/PERFORMANCE.md)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="write the headline figures into this README between its markers")
    args = parser.parse_args(argv)
    data = load(args.results)
    source = relative(args.results)
    if args.out is None and args.readme is None:
        print(page(data, source=source))
    if args.out is not None:
        kept = findings_of(args.out.read_text()) if args.out.exists() else ""
        args.out.write_text(page(data, source=source, findings=kept))
    if args.readme is not None:
        write_into(args.readme, readme_block(data, source=source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
