"""Benchmark of kvmove's SGLang backend against SGLang's own Mooncake backend, on the same
host pool pages, the real SGLang 0.5.23 classes and one embedded Mooncake master.

1. Descriptor build: what each backend computes from the page keys and host indices it is
   handed before a zero-copy put or get of K pages of an MLA host pool (object keys plus
   pointer and size lists): SGLang's ``_tag_keys`` and ``_batch_preprocess``
   (``get_page_buffer_meta``, a Python loop over (page, layer), then
   ``_pack_multi_buffer_meta``), as its ``batch_get_v1`` / ``batch_set_v1`` call them,
   against kvmove's (object keys in one pass, ``HostPool.describe``: numpy, one
   ``tolist()``). Default: 1, 8, 64, 512 and 4096 one-token pages x 61 layers (a decode
   step's few pages, where fixed costs per call decide, up to a large batch), layer_first
   and page_first. Goal: >= 1.0x at every count; where there is per-(page, layer) work
   (layer_first: 61 spans per page) the target is also >= 5x.
2. End to end: ``batch_set_v1`` of fresh pages, then ``batch_get_v1`` of them into another
   pool region, through each backend, interleaved: 1 to 4096 one-token pages and 32
   16-token pages. Goal: >= 1.0x (SGLang's time / kvmove's). kvmove moves ``layer_first``
   pages in place or staged, as its ``auto`` path chooses when the pool is registered
   (:mod:`kvmove.integrations.sglang.staged`); the table says which.

Every figure is the median of the per-repeat ratios (SGLang's time over kvmove's in the
same repeat) with its quartiles, and its verdict (:mod:`bench.speedup_goal`): met, missed,
or within noise where the quartiles straddle the goal. A case whose rounds are slow gets
fewer of them (at least 3), within ``--e2e-seconds``.

Needs SGLang (run it with the SGLang venv that ``scripts/test_sglang.sh`` sets up)::

    .venv-sglang/bin/python -m bench.bench_sglang           # prints the tables
    .venv-sglang/bin/python -m bench.bench_sglang --json    # also bench/results/bench_sglang.json

The objects live in the segment of a third client (the "holder"): both backends contribute
no memory, so each reads every page over loopback TCP from the same place. (With segments of
their own, the master's placement decides which reads are local copies, and that, not the
backend, would decide the figures.)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# SGLang's config package imports torchvision at module level (see the stand-in's docstring).
sys.path.insert(0, str(ROOT / "tests" / "integrations" / "sglang" / "stand_ins"))

import kvmove  # noqa: E402
from bench import results  # noqa: E402
from bench.speedup_goal import marked, paired  # noqa: E402
from bench.timing import measure  # noqa: E402

MLA_DIM = 576
GOAL = 1.0  # kvmove at least as fast as SGLang's own backend, at every batch size
LOOP_TARGET = 5.0  # descriptors where SGLang loops over (page, layer)
PAGE_COUNTS = [1, 8, 64, 512, 4096]


def mla_pool(layout: str, *, layers: int, page_size: int, tokens: int):
    """SGLang's CPU MLA host pool of at least ``tokens`` slots, filled with bytes."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = [torch.zeros(1, 1, MLA_DIM, dtype=torch.bfloat16) for _ in range(layers)]
    info = MLABufferInfo(
        buffers=tuple(device), data_ptrs=torch.tensor([t.data_ptr() for t in device]),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
        kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=MLA_DIM, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(
        info, host_to_device_ratio=1.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=tokens, start_layer=0,
        end_layer=layers, target_layer_num=layers)
    pool.kv_buffer.view(torch.uint8).view(-1)[::4096] = 7  # touch every page of memory
    return pool


def storage_config(model: str, page_first: bool):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=page_first,
        model_name=model, extra_config={})


def make_backends(model: str, page_first: bool):
    """(SGLang's MooncakeStore, kvmove's backend through SGLang's "dynamic" factory)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    sglang = MooncakeStore(storage_config(model, page_first))
    config = storage_config(model, page_first)
    config.extra_config.update({"backend_name": "kvmove",
                                "module_path": "kvmove.integrations.sglang",
                                "class_name": "KVMoveStorage", "interface_v1": 1})
    ours = StorageBackendFactory.create_backend("dynamic", config, None)
    return sglang, ours


def bench_describe(args, layout: str, pages: int) -> dict:
    pool = mla_pool(layout, layers=args.layers, page_size=1, tokens=pages)
    sglang, ours = make_backends(f"bench/describe-{uuid.uuid4().hex[:8]}",
                                 layout != "layer_first")
    try:
        sglang.register_mem_pool_host(pool)
        ours.register_mem_pool_host(pool)
        keys = [uuid.uuid4().hex for _ in range(pages)]
        idx = torch.arange(pages, dtype=torch.int64)

        def sglang_meta():  # what SGLang's batch_get_v1 / batch_set_v1 do before the store
            return sglang._batch_preprocess(sglang._tag_keys(keys), idx)

        def kvmove_meta():  # what kvmove's do
            return ours._describe(ours.kv, ours.keys.kv_objects(keys), idx)

        a, b = sglang_meta(), kvmove_meta()  # the same objects, span for span
        flat = [p if isinstance(p, list) else [p] for p in a[1]]
        if a[0] != b.keys or flat != b.ptrs:
            raise AssertionError("kvmove and SGLang describe different objects")
        timing = measure({"sglang": sglang_meta, "kvmove": kvmove_meta},
                         device=torch.device("cpu"), warmup=2, repeats=args.repeat,
                         min_sample_s=0.02)
    finally:
        sglang.close()
        sglang.store.close()  # SGLang's close() leaves its Mooncake client open
        ours.close()
    med = {k: t.median for k, t in timing.items()}
    return {"layout": layout, "pages": pages, "layers": args.layers, "page_size": 1,
            "spans_per_key": len(b.ptrs[0]), "median_s": med,
            "best_s": {k: min(t.samples) for k, t in timing.items()},
            "spread": {k: t.spread for k, t in timing.items()},
            "speedup": med["sglang"] / med["kvmove"],
            "goal": paired(timing["sglang"].samples, timing["kvmove"].samples, GOAL),
            "loop_target": (paired(timing["sglang"].samples, timing["kvmove"].samples,
                                   LOOP_TARGET) if len(b.ptrs[0]) > 1 else None)}


def bench_end_to_end(args, layout: str, holder, pages: int, page_size: int) -> dict:
    pool = mla_pool(layout, layers=args.layers, page_size=page_size,
                    tokens=2 * pages * page_size)
    sglang, ours = make_backends(f"bench/e2e-{uuid.uuid4().hex[:8]}", layout != "layer_first")
    src = torch.arange(pages * page_size, dtype=torch.int64)
    dst = src + pages * page_size
    samples: dict[str, list[float]] = {f"{w} {op}": [] for w in ("sglang", "kvmove")
                                       for op in ("set", "get")}
    try:
        sglang.register_mem_pool_host(pool)
        ours.register_mem_pool_host(pool)
        choice = ours.staged.choice if ours.staged is not None else None
        path = ({"set": "in_place", "get": "in_place", "why": "one span per page"}
                if choice is None else
                {"set": choice.evict, "get": choice.prefetch, "why": choice.reason})
        rounds, r, t_start = args.e2e_repeat + 1, 0, time.perf_counter()
        while r < rounds:  # the first round warms up
            if r == 1:  # slow rounds: fewer of them (at least 3), within the time budget
                took = time.perf_counter() - t_start
                rounds = 1 + max(3, min(args.e2e_repeat, int(args.e2e_seconds / took)))
            order, failures = [("sglang", sglang), ("kvmove", ours)], []
            for name, backend in order if r % 2 == 0 else order[::-1]:
                keys = [uuid.uuid4().hex for _ in range(pages)]
                t0 = time.perf_counter()
                put = backend.batch_set_v1(keys, src)
                t1 = time.perf_counter()
                got = backend.batch_get_v1(keys, dst)
                t2 = time.perf_counter()
                if not (all(put) and all(got)):
                    failures.append(f"{name}: set {put.count(True)}/{pages}, get "
                                    f"{got.count(True)}/{pages}")
                elif r:
                    samples[f"{name} set"].append(t1 - t0)
                    samples[f"{name} get"].append(t2 - t1)
                # both backends name the objects alike; free the holder's memory
                holder.remove([k for ks in ours.keys.kv_objects(keys) for k in ks], force=True)
            if failures:  # both backends tried: the record says which failed
                raise AssertionError("; ".join(sorted(failures)))
            r += 1
    finally:
        sglang.close()
        sglang.store.close()  # SGLang's close() leaves its Mooncake client open
        ours.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    nbytes = pages * page_size * args.layers * MLA_DIM * 2
    return {"layout": layout, "pages": pages, "page_size": page_size, "layers": args.layers,
            "bytes": nbytes, "median_s": med,
            "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
            "speedup_set": med["sglang set"] / med["kvmove set"],
            "speedup_get": med["sglang get"] / med["kvmove get"], "kvmove_path": path,
            "repeats": len(samples["kvmove set"]),
            "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in samples.items()},
            "goal": {op: paired(samples[f"sglang {op}"], samples[f"kvmove {op}"], GOAL)
                     for op in ("set", "get")}}


def end_to_end_or_failure(args, layout: str, holder, pages: int, page_size: int) -> dict:
    """:func:`bench_end_to_end`, or the record of why a backend's set or get failed (with
    Mooncake 0.3.13 over TCP, puts of many small spans to a remote segment fail: measured,
    SGLang's own backend stored 106 of 4096 one-token layer_first pages, 250k spans of
    1152 B, in 62 s, and read none)."""
    try:
        return bench_end_to_end(args, layout, holder, pages, page_size)
    except AssertionError as e:
        return {"layout": layout, "pages": pages, "page_size": page_size,
                "layers": args.layers, "failed": str(e)}


def report(result: dict, console: Console) -> None:
    rows = result.get("describe", [])
    if rows:
        table = Table(title=f"descriptor build (keys + span lists) before a put/get, MLA pool; "
                            f"SGLang's time / kvmove's per repeat: median (quartiles), "
                            f"against >= {GOAL:g}x")
        for col in ("layout", "pages x layers", "spans/key", "SGLang ms", "kvmove ms",
                    f">= {GOAL:g}x", f">= {LOOP_TARGET:g}x (loops)"):
            table.add_column(col, justify="right")
        for d in rows:
            loop = d.get("loop_target")
            table.add_row(d["layout"], f"{d['pages']} x {d['layers']}", str(d["spans_per_key"]),
                          f"{d['median_s']['sglang'] * 1e3:.3f}",
                          f"{d['median_s']['kvmove'] * 1e3:.3f}", marked(d["goal"]),
                          marked(loop) if loop else "-")
        console.print(table)
    rows = result.get("end_to_end", [])
    if rows:
        table = Table(title=f"batch_set_v1 / batch_get_v1 over loopback TCP: GB/s (medians), "
                            f"SGLang's time / kvmove's per repeat against >= {GOAL:g}x")
        for col in ("layout", "pages x tokens", "MiB", "repeats", "SGLang set", "kvmove set",
                    "set", "SGLang get", "kvmove get", "get", "kvmove path (set/get)"):
            table.add_column(col, justify="right")
        for e in rows:
            if "failed" in e:
                table.add_row(e["layout"], f"{e['pages']} x {e['page_size']}", "", "", "", "",
                              f"failed: {e['failed']}", "", "", "", "")
                continue
            g = e["GBps"]
            table.add_row(e["layout"], f"{e['pages']} x {e['page_size']}",
                          f"{e['bytes'] / 2**20:.1f}", str(e["repeats"]),
                          f"{g['sglang set']:.2f}", f"{g['kvmove set']:.2f}",
                          marked(e["goal"]["set"]), f"{g['sglang get']:.2f}",
                          f"{g['kvmove get']:.2f}", marked(e["goal"]["get"]),
                          _path(e.get("kvmove_path")))
        console.print(table)
    verdicts = [d["goal"]["verdict"] for d in result.get("describe", [])] + [
        e["goal"][op]["verdict"] for e in result.get("end_to_end", []) if "goal" in e
        for op in ("set", "get")]
    failed = sum("failed" in e for e in result.get("end_to_end", []))
    if verdicts:
        console.print(f"against >= {GOAL:g}x: " + ", ".join(
            f"{verdicts.count(v)} {v}" for v in ("met", "within noise", "missed"))
            + (f"; {failed} end-to-end case(s) not judged: a backend failed" if failed else ""))
        for e in rows:
            why = (e.get("kvmove_path") or {}).get("why", "")
            if why.startswith("auto"):
                console.print(f"kvmove's path, {e['layout']} {e['pages']} x "
                              f"{e['page_size']}: {why}")


def _path(path: dict | None) -> str:
    if not path:
        return ""
    return path["set"] if path["set"] == path["get"] else f"{path['set']}/{path['get']}"


def _case(text: str) -> tuple[int, int]:
    pages, _, tokens = text.partition("x")
    return int(pages), int(tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, nargs="+", default=PAGE_COUNTS,
                   help="pages of the descriptor build (one build per count)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--repeat", type=int, default=9, help="descriptor build repeats")
    p.add_argument("--e2e-cases", nargs="+", type=_case,
                   default=[(n, 1) for n in PAGE_COUNTS] + [(32, 16)],
                   metavar="PAGESxTOKENS", help="set/get batches: pages x tokens per page")
    p.add_argument("--e2e-repeat", type=int, default=12, help="most repeats of a case")
    p.add_argument("--e2e-seconds", type=float, default=60.0,
                   help="time budget of a case's repeats (at least 3 are made)")
    p.add_argument("--layouts", nargs="+", default=["layer_first", "page_first"],
                   choices=["layer_first", "page_first", "page_first_direct"])
    p.add_argument("--holder-bytes", type=int, default=2 << 30,
                   help="the segment that holds the objects")
    p.add_argument("--quick", action="store_true", help="fewer pages and repeats")
    p.add_argument("--json", nargs="?", const=str(RESULTS / "bench_sglang.json"), default=None,
                   metavar="PATH", help="also write the results as JSON (default path: "
                                        "bench/results/bench_sglang.json)")
    args = p.parse_args(argv)
    if args.quick:  # the same sizes, a shorter time budget per case
        # Up to 20 repeats where a case is fast (within the same 15 s a case had): with 6,
        # the quartiles of the small cases' ratios spread too wide to tell a real shortfall
        # from the VM's noise (measured: page_first 512 x 1 "missed" at 0.82x over 6
        # repeats, 1.00x within noise over 30).
        args.repeat, args.e2e_repeat, args.e2e_seconds = 5, 20, 15.0
    master = kvmove.EmbeddedMaster()
    holder = kvmove.MooncakeStore(kvmove.StoreConfig(
        master_address=master.address, local_hostname="127.0.0.1",
        global_segment_size=args.holder_bytes))
    os.environ.update({"MOONCAKE_MASTER": master.address, "MOONCAKE_PROTOCOL": "tcp",
                       "MOONCAKE_DEVICE": "", "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
                       "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
                       "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1"})
    result = {
        "benchmark": "bench_sglang", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join(["python -m bench.bench_sglang", *(argv or sys.argv[1:])]),
    }
    try:
        import sglang

        result["sglang"] = sglang.__version__
        result["describe"] = [bench_describe(args, layout, pages) for pages in args.pages
                              for layout in args.layouts]
        result["end_to_end"] = [end_to_end_or_failure(args, layout, holder, *case)
                                for case in args.e2e_cases for layout in args.layouts]
    finally:
        holder.close()
        master.stop()
    return results.finish_suite(result, report, Path(args.json) if args.json else None)


if __name__ == "__main__":
    sys.exit(main())
