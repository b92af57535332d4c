"""A figure against a speed goal, from the paired timings of one interleaved run: per repeat,
the baseline's time over kvmove's (> 1: kvmove faster), and its median and quartiles.
``met`` when the lower quartile reaches the goal, ``missed`` when the upper quartile falls
short of it, else ``within noise`` (the spread covers the goal: neither met nor missed)."""

from __future__ import annotations

import statistics

MET, MISSED, NOISE = "met", "missed", "within noise"


def paired(theirs: list[float], ours: list[float], goal: float = 1.0) -> dict:
    """``{"median", "q1", "q3", "goal", "verdict"}`` of the per-repeat ratios
    ``theirs[i] / ours[i]`` (seconds of the same repeat)."""
    if not theirs or len(theirs) != len(ours):
        raise ValueError(f"paired timings need as many baseline as kvmove samples, got "
                         f"{len(theirs)} and {len(ours)}")
    ratios = [a / b for a, b in zip(theirs, ours, strict=True)]
    q1, q3 = (statistics.quantiles(ratios, n=4, method="inclusive")[0::2]
              if len(ratios) > 1 else (ratios[0], ratios[0]))
    verdict = MET if q1 >= goal else MISSED if q3 < goal else NOISE
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "goal": goal,
            "verdict": verdict}


def cell(figure: dict) -> str:
    """``"1.07x (0.98-1.12) within noise"``: the median, quartiles and verdict."""
    return (f"{figure['median']:.2f}x ({figure['q1']:.2f}-{figure['q3']:.2f}) "
            f"{figure['verdict']}")


def marked(figure: dict) -> str:
    """:func:`cell` coloured for a rich table."""
    colour = {MET: "green", MISSED: "red", NOISE: "yellow"}[figure["verdict"]]
    return f"[{colour}]{cell(figure)}[/{colour}]"
