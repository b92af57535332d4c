"""Ratios and headline figures from a results file: each kvmove figure over its baselines
from the same run, and the figures the targets name (reported, never asserted)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.speedup_goal import MET, MISSED, NOISE, paired

LABELS = {
    "triton": "triton (direct)",
    "two_hop": "two-hop",
    "torch": "torch",
    "torch-unchecked": "torch, check=False",
    "bulk": "bulk copy",
    "primitive": "torch primitive",
    "primitive_units": "primitive as called",
    "memcpy_page": "memcpy per page",
    "memcpy_row": "memcpy per row",
    "cpu_rearrange": "CPU rearrange",
}
PRIMITIVE = {"gather": "index_select", "scatter": "index_copy_"}
LARGE_BYTES = 32 << 20  # copies this large amortise the per-call validation and set-up
# The torch floor (CPU): the torch backend at >= 0.95x the primitive calls it makes, made
# plainly, and >= 1.0x a plain per-layer index_select / index_copy_, at every shape.
FLOOR_AS_CALLED = 0.95
FLOOR_PLAIN = 1.0
ORDER = ("triton", "torch", "two_hop", "torch-unchecked", "bulk", "primitive",
         "primitive_units", "memcpy_page",
         "memcpy_row", "cpu_rearrange")


def cache_of(record: dict) -> str:
    """How the case's KV cache was given ("stacked" or "per_layer"; older results files
    measured stacked caches only)."""
    return record.get("cache", "stacked")


def caches_of(records: list[dict]) -> list[str]:
    return sorted({cache_of(r) for r in records}, key=lambda c: (c != "stacked", c))


def methods_of(records: list[dict], kind: str) -> list[str]:
    """Method names of one kind ("kvmove" or "baseline") present in the records, in
    display order."""
    present = {n for r in records for n, m in r["methods"].items() if m["kind"] == kind}
    return [n for n in ORDER if n in present] + sorted(present - set(ORDER))


def ratio(record: dict, method: str, baseline: str) -> float | None:
    m = record["methods"]
    if method not in m or baseline not in m:
        return None
    return m[method]["gbps"] / m[baseline]["gbps"]


def ratio_noise(record: dict, method: str, baseline: str) -> float | None:
    """The run's own spread of ``ratio(record, method, baseline)``, relative: half the sum of
    the two figures' spreads ((max - min) / median of their repeats, as the results file
    records them). None where the run recorded no spread for either."""
    m = record["methods"]
    spreads = [m[n]["spread"] for n in (method, baseline) if n in m and "spread" in m[n]]
    return sum(spreads) / 2 if len(spreads) == 2 else None


def short_of(value: float | None, goal: float, noise: float | None) -> bool:
    """True where ``value`` falls short of ``goal`` (higher is better) by more than the
    run's own spread (``noise``, relative to the goal; None: no spread recorded, so any
    shortfall counts)."""
    return value is not None and goal - value > goal * (noise or 0.0)


def largest_cases(records: list[dict]) -> list[dict]:
    """Per (direction, cache, row bytes, page tokens), the record with the most pages."""
    best: dict[tuple, dict] = {}
    for r in records:
        key = (r["direction"], cache_of(r), r["row_bytes"], r["page_tokens"])
        if key not in best or r["pages"] > best[key]["pages"]:
            best[key] = r
    return [best[k] for k in sorted(best)]


@dataclass
class RatioStats:
    direction: str
    cache: str
    method: str
    baseline: str
    median: float
    low: float
    high: float
    cases: int


def ratio_stats(records: list[dict]) -> list[RatioStats]:
    """For each direction, cache, kvmove method and baseline: the median, min and max
    ratio over all cases."""
    out = []
    for direction in ("gather", "scatter"):
        for cache in caches_of(records):
            rs = [r for r in records if r["direction"] == direction and cache_of(r) == cache]
            for method in methods_of(rs, "kvmove"):
                for baseline in methods_of(rs, "baseline"):
                    values = [v for r in rs if (v := ratio(r, method, baseline)) is not None]
                    if values:
                        out.append(RatioStats(direction, cache, method, baseline,
                                              statistics.median(values), min(values),
                                              max(values), len(values)))
    return out


@dataclass
class Headline:
    text: str
    value: float | None
    target: float | None = None  # None: a fact to show, not a target
    noise: float | None = None  # the run's own spread of ``value``, relative (None: unknown)

    @property
    def met(self) -> bool | None:
        if self.target is None or self.value is None:
            return None
        return self.value >= self.target

    @property
    def behind(self) -> bool:
        """Short of the target by more than the run's own spread."""
        return self.target is not None and short_of(self.value, self.target, self.noise)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratios(records, direction, method, baseline, **where) -> list[float]:
    return [v for r in records
            if r["direction"] == direction and all(r[k] == x for k, x in where.items())
            if (v := ratio(r, method, baseline)) is not None]


def _noises(records, direction, method, baseline, **where) -> float | None:
    """The median spread of the ratios ``_ratios`` takes (None where none is recorded)."""
    return _median([n for r in records
                    if r["direction"] == direction and all(r[k] == x for k, x in where.items())
                    if (n := ratio_noise(r, method, baseline)) is not None])


def _worst(records, direction, cache, method, baseline) -> tuple[float, dict] | None:
    """The lowest ratio of ``method`` over ``baseline`` among the cases of one direction and
    cache, and its record; None where there is none."""
    found = [(v, r) for r in records
             if r["direction"] == direction and cache_of(r) == cache
             if (v := ratio(r, method, baseline)) is not None]
    return min(found, key=lambda x: x[0]) if found else None


def _as_called(record: dict) -> str | None:
    """The baseline of the primitive calls torch makes in this case: on units where it moves
    whole pages (and widened scatters), else the plain rows one."""
    m = record["methods"]
    return next((b for b in ("primitive_units", "primitive") if b in m), None)


def _own_cost(records: list[dict]) -> list[float]:
    """torch over the primitive calls it makes, per case."""
    return [v for r in records if (b := _as_called(r)) and (v := ratio(r, "torch", b))]


def _own_noise(records: list[dict]) -> float | None:
    return _median([n for r in records
                    if (b := _as_called(r)) and (n := ratio_noise(r, "torch", b)) is not None])


@dataclass
class FloorFigure:
    """torch against one baseline on one case: the per-repeat ratios of the baseline's time
    over torch's (> 1: torch faster), their median and quartiles, and the verdict against
    ``goal`` (:func:`bench.speedup_goal.paired`: met, missed, or within noise)."""

    record: dict
    baseline: str
    figure: dict  # :func:`bench.speedup_goal.paired`'s: median, q1, q3, goal, verdict
    spread: float | None  # the run's own spread of the ratio (:func:`ratio_noise`)

    @property
    def goal(self) -> float:
        return self.figure["goal"]

    @property
    def median(self) -> float:
        return self.figure["median"]

    @property
    def verdict(self) -> str:
        return self.figure["verdict"]

    def shape(self) -> str:
        r = self.record
        return (f"{r['direction']} {cache_of(r).replace('_', '-')}, {r['row_bytes']} B x "
                f"{r['page_tokens']} tokens x {r['pages']} pages")


def floor_figures(records: list[dict]) -> list[FloorFigure]:
    """Per CPU case with a torch figure: torch against the primitive calls it makes (goal
    :data:`FLOOR_AS_CALLED`) and against the plain per-layer index op (goal
    :data:`FLOOR_PLAIN`), from the samples of the same interleaved repeats. Where the calls
    it makes are the plain op itself, one figure, against the stricter goal."""
    out = []
    for r in records:
        m = r["methods"]
        if "torch" not in m or not m["torch"].get("samples_s"):
            continue
        called = _as_called(r)
        goals = {"primitive": FLOOR_PLAIN}
        if called not in (None, "primitive"):
            goals[called] = FLOOR_AS_CALLED
        for base, goal in goals.items():
            if base not in m or len(m[base].get("samples_s", ())) != len(m["torch"]["samples_s"]):
                continue
            out.append(FloorFigure(r, base, paired(m[base]["samples_s"],
                                                   m["torch"]["samples_s"], goal),
                                   ratio_noise(r, "torch", base)))
    return out


def floor_counts(figures: list[FloorFigure]) -> dict[str, int]:
    """How many figures are met, within noise and missed."""
    return {v: sum(f.verdict == v for f in figures) for v in (MET, NOISE, MISSED)}


def headlines(data: dict) -> list[Headline]:
    """The figures the targets speak of, computed from this run."""
    records = data["kernels"]
    gpu = data["machine"].get("gpu") is not None
    out: list[Headline] = []
    if not gpu:
        for d in ("gather", "scatter"):
            v = _ratios(records, d, "torch", "primitive")
            out.append(Headline(f"torch {d} vs a plain per-layer {PRIMITIVE[d]} of the rows "
                                f"(median of {len(v)} cases, {min(v, default=0):.2f}-"
                                f"{max(v, default=0):.2f}x)", _median(v), FLOOR_PLAIN,
                                _noises(records, d, "torch", "primitive")))
        for cache in caches_of(records):
            for d in ("gather", "scatter"):
                worst = _worst(records, d, cache, "torch", "primitive")
                if worst is not None:
                    v, r = worst
                    out.append(Headline(f"torch {d} vs a plain per-layer {PRIMITIVE[d]}, the "
                                        f"worst case on {cache.replace('_', '-')} caches "
                                        f"({r['row_bytes']} B x {r['page_tokens']} tokens x "
                                        f"{r['pages']} pages)", v, FLOOR_PLAIN,
                                        ratio_noise(r, "torch", "primitive")))
        for d in ("gather", "scatter"):
            rs = [r for r in records if r["direction"] == d]
            v = _own_cost(rs)
            extra = _median([r["methods"]["torch"]["median_s"] - r["methods"][b]["median_s"]
                             for r in rs if "torch" in r["methods"] and (b := _as_called(r))])
            out.append(Headline(f"torch {d} vs the primitive calls it makes, made plainly "
                                f"(its own cost; median of {len(v)} cases, "
                                f"{min(v, default=0):.2f}-{max(v, default=0):.2f}x; it adds "
                                f"{(extra or 0) * 1e3:.2f} ms per call, median)",
                                _median(v), FLOOR_AS_CALLED, _own_noise(rs)))
            big = [r for r in records if r["direction"] == d and r["bytes"] >= LARGE_BYTES]
            v = _own_cost(big)
            if v:
                out.append(Headline(f"the same, copies of >= {LARGE_BYTES >> 20} MiB (median of "
                                    f"{len(v)} cases; smaller ones pay a fixed cost per call)",
                                    _median(v), FLOOR_AS_CALLED, _own_noise(big)))
        for d in ("gather", "scatter"):
            v = _ratios(records, d, "torch", "memcpy_row", row_bytes=656)
            out.append(Headline(f"torch {d} vs memcpy per row, 656-byte rows (median of "
                                f"{len(v)} cases)", _median(v), 10.0,
                                _noises(records, d, "torch", "memcpy_row", row_bytes=656)))
        for rb in sorted({r["row_bytes"] for r in records}):
            for d in ("gather", "scatter"):
                v = _ratios(records, d, "torch", "bulk", row_bytes=rb)
                if v:
                    out.append(Headline(f"torch {d} vs bulk copy, {rb}-byte rows (median)",
                                        _median(v)))
        return out
    direct = "triton"
    for d, base, target in (("gather", "bulk", 0.9), ("scatter", "bulk", 0.85)):
        v = _ratios(records, d, direct, base, row_bytes=656, page_tokens=64)
        out.append(Headline(f"direct {d} vs bulk {'D2H' if d == 'gather' else 'H2D'}, "
                            f"656-byte rows, 64-token pages", _median(v), target,
                            _noises(records, d, direct, base, row_bytes=656, page_tokens=64)))
    for base, target in (("memcpy_page", 10.0), ("cpu_rearrange", 2.0)):
        for d in ("gather", "scatter"):
            v = _ratios(records, d, direct, base, row_bytes=656, page_tokens=64)
            out.append(Headline(f"direct {d} vs {LABELS[base]}, 656-byte rows, 64-token pages",
                                _median(v), target,
                                _noises(records, d, direct, base, row_bytes=656,
                                        page_tokens=64)))
    for d in ("gather", "scatter"):
        v = _ratios(records, d, "two_hop", direct)
        out.append(Headline(f"two-hop {d} vs direct (median over all cases; > 1: two-hop "
                            f"faster)", _median(v)))
    return out


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
