"""The kernel benchmark: kvmove's gather and scatter, per backend, against the baselines
(:mod:`bench.baselines`) on the same data in the same run, over the grid of
:mod:`bench.cases`. Every kvmove method's bytes are checked once per case before timing.

kvmove methods: on a GPU ``triton`` (the direct kernel: it writes pinned host memory
itself) and ``two_hop`` (device ring + copy engine); on the CPU ``torch`` (the fast path
there) and ``two_hop`` (host ring: shows what the detour costs). The Triton interpreter is
a correctness tool, not a CPU path, and is not timed. ``torch-unchecked`` (the torch
backend with ``check=False``) can be asked for by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

import kvmove
from bench import baselines
from bench.cases import Case, Settings, grid
from bench.timing import measure
from bench.workload import Workload

log = logging.getLogger(__name__)

KVMOVE_METHODS = ("triton", "two_hop", "torch", "torch-unchecked")


def default_methods(device: torch.device) -> tuple[str, ...]:
    kvmove_methods = ("triton", "two_hop") if device.type == "cuda" else ("torch", "two_hop")
    return kvmove_methods + baselines.BASELINES


def kvmove_method(w: Workload, case: Case, name: str) -> Callable[[], None]:
    token_pages, slots, _ = w.indices(case.pages)
    backend, check = (("torch", False) if name == "torch-unchecked" else (name, True))
    if case.direction == "gather":
        return lambda: kvmove.gather(w.kv, w.staging, token_pages, slots, backend=backend,
                                     check=check)
    return lambda: kvmove.scatter(w.staging, slots, w.kv, token_pages, backend=backend,
                                  check=check)


def run_case(w: Workload, case: Case, methods: tuple[str, ...], settings: Settings) -> dict:
    """Check and time every method on one case; the case's JSON record."""
    fns: dict[str, Callable[[], None]] = {}
    nbytes: dict[str, int] = {}
    for name in methods:
        if name in KVMOVE_METHODS:
            fn = kvmove_method(w, case, name)
            w.poison(case.direction, case.pages)
            fn()
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)
            w.check(case.direction, case.pages)
            fns[name], nbytes[name] = fn, case.nbytes
        else:
            built = baselines.build(name, w, case, max_calls=settings.max_calls)
            if built is not None:
                fns[name], nbytes[name] = built
    timings = measure(fns, device=w.device, warmup=settings.warmup, repeats=settings.repeats,
                      min_sample_s=settings.min_sample_s)
    return {
        "direction": case.direction, "cache": w.cache, "row_bytes": case.row_bytes,
        "page_tokens": case.page_tokens, "pages": case.pages, "layers": case.layers,
        "bytes": case.nbytes,
        "methods": {
            name: {
                "kind": "kvmove" if name in KVMOVE_METHODS else "baseline",
                "bytes": nbytes[name],
                "median_s": t.median,
                "gbps": nbytes[name] / t.median / 1e9,
                "spread": round(t.spread, 3),
                "calls_per_sample": t.calls,
                "samples_s": t.samples,
            }
            for name, t in timings.items()
        },
    }


def run_kernels(settings: Settings, progress: Callable[[str], None] = print,
                on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Every case of the grid; one record per case (``on_record`` sees each as it comes)."""
    methods = settings.methods or default_methods(settings.device)
    unknown = set(methods) - set(KVMOVE_METHODS) - set(baselines.BASELINES)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; known: "
                         f"{list(KVMOVE_METHODS) + list(baselines.BASELINES)}")
    if settings.device.type != "cuda" and "triton" in methods:
        raise ValueError("the triton method needs a GPU (the interpreter is not a CPU path)")
    records = []
    combos = [(cache, *c) for cache in settings.caches for c in grid(settings)]
    for i, (cache, rb, pt, page_counts) in enumerate(combos, 1):
        w = Workload(rb, pt, max(page_counts), settings.layers, settings.device, cache=cache)
        try:
            for pages in page_counts:
                for direction in settings.directions:
                    case = Case(direction, rb, pt, pages, settings.layers)
                    record = run_case(w, case, methods, settings)
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                    figures = ", ".join(f"{n} {m['gbps']:.2f}"
                                        for n, m in record["methods"].items())
                    progress(f"[{i}/{len(combos)}] {cache} {direction} {rb} B x {pt} tokens x "
                             f"{pages} pages x {settings.layers} layers "
                             f"({case.nbytes / 2**20:.1f} MiB): {figures} GB/s")
        finally:
            w.close()
            del w
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()
    return records
