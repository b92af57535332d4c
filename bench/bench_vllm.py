"""Save and load of the same vLLM KV blocks: kvmove's vLLM connector path against vLLM's own
``MooncakeStoreConnector`` path, in the same run, on the same KV tensors and store.

- kvmove: the connector's worker path: the KV cache as ``block_regions`` views and the
  connector's own ``KVMover`` (``block_mover``: raw vLLM keys, loads into free blocks) with
  its default ``path="auto"`` (what it picks is reported): save = a put straight from the
  blocks, or a gather into staging + put; load = a get straight into the blocks, or get +
  scatter. "kvmove load" is the connector's default, asynchronous load: the prefetch runs
  on the mover's worker thread while the caller waits without taking it over (a request
  waits for its blocks while the engine steps on); "kvmove load (in the step)" and
  "(layer-wise)" are its loads with ``load_async`` off, inside the step (the caller takes
  the job over when no worker has started it). The blocks saved are new, as a request's
  blocks that its lookup found in no namespace: the connector saves those without asking
  the master which exist ("kvmove save"); "kvmove save (exists query)" is the save of
  blocks the lookup did not vouch for (it asks first, as vLLM's connector always does).
- vLLM: its worker's data path: ``RankLocalStoreLayout.prepare_values`` descriptors straight
  into the registered KV cache, ``batch_is_exist`` + ``batch_put_from_multi_buffers`` on save,
  ``batch_get_into_multi_buffers`` on load (zero copy). Its connector makes these calls on
  its send and receive threads (vLLM's ``KVTransferThread``: a request queue, a daemon
  thread; loads are always asynchronous, ``load_async`` is asserted), and so does this
  bench, on a ``KVTransferThread`` of vLLM's own code: "vLLM save" / "vLLM load", the
  figures the ratios are taken against. The same calls made on the caller's thread, with
  no thread between (what no vLLM configuration does), are reported too: "(inline)".
- "save returns": how long the caller's (the engine's) thread waits in the save. vLLM's
  connector hands the save to its send thread; kvmove's evict returns once the put is under
  way (in place, the put runs in the background: in an engine, vLLM's scheduler holds the
  blocks until the worker reports the put done). "load returns": the same for an
  asynchronous load (vLLM's hand-off to its receive thread; kvmove's prefetch call).

Both talk to one embedded master through one Mooncake client, over loopback TCP. Needs the
vLLM environment (``bash scripts/test_vllm.sh --setup-only``)::

    .venv-vllm/bin/python -m bench.bench_vllm [--quick] [--json PATH]

Figures are medians of interleaved repeats (kvmove and vLLM alternate within each repeat);
every repeat checks the loaded bytes against the saved ones. One run measures 1, 16 and 256
blocks (``--blocks``); each save and load is judged against >= 1.0x vLLM's
(:mod:`bench.speedup_goal`: the median and quartiles of the per-repeat ratios; met, missed,
or within noise where the quartiles straddle the goal). Small cases get more repeats
(``--case-seconds``, at most ``--max-repeat``). The caller waits for a
transfer the same way on both sides: ``Transfer.wait()``, or an event the vLLM thread sets
after its call.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
from rich.table import Table

import kvmove
from bench import results
from bench.speedup_goal import marked, paired

GOAL = 1.0  # kvmove's save and load at least as fast as vLLM's own connector path
BLOCK_COUNTS = [1, 16, 256]

RESULTS = Path(__file__).resolve().parent / "results"


def llama_like_cache(layers: int, blocks: int, heads: int, block_size: int,
                     head_dim: int) -> list[torch.Tensor]:
    """vLLM's CPU layout (LBHNC): per layer ``[blocks, heads, block_size, 2 * head_dim]``
    bf16 (K and V together), all layers views into one storage."""
    full = torch.empty(layers, blocks, heads, block_size, 2 * head_dim, dtype=torch.bfloat16)
    full.view(torch.int16).random_(-(1 << 15), 1 << 15)
    return [full[i] for i in range(layers)]


def transfer_thread(block_size: int):
    """A started thread of vLLM's ``KVTransferThread`` (the base of its connector's send
    and receive threads: its request queue and daemon loop) whose requests are ``(call,
    done)``: it runs ``call()`` as its ``_handle_request`` would, then sets ``done``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        KVTransferThread,
    )

    class Thread(KVTransferThread):
        def _handle_request(self, request) -> None:
            call, done = request
            try:
                call()
            finally:
                self.request_queue.task_done()
                done.set()

    ready = threading.Event()
    thread = Thread(None, [], block_size, 0, ready, "bench-vllm-transfer")
    thread.start()
    ready.wait()
    return thread


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(args, n: int) -> dict:
    """The figures of saves and loads of ``n`` blocks."""
    from mooncake.store import ReplicateConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        KeyMetadata,
        RankLocalStoreLayout,
    )

    from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat
    from kvmove.integrations.vllm.layout import block_regions
    from kvmove.integrations.vllm.worker import block_mover, block_pages

    bs = args.block_size
    num_blocks = 2 * n + 1
    src = llama_like_cache(args.layers, num_blocks, args.heads, bs, args.head_dim)
    storage = src[0].untyped_storage()
    save_ids = list(range(2 * n - 1, 0, -2))[:n]  # scattered, descending (as vLLM hands out)
    load_ids = [b - 1 for b in save_ids]
    object_bytes = sum(t[0].numel() * t.element_size() for t in src)
    total = n * object_bytes
    fmt, ns = VLLMKeyFormat("bench-llama"), RankNamespace()

    vllm = RankLocalStoreLayout(KeyMetadata("bench-llama", 0, 0, 0, 0), bs, bs)
    vllm.register_kv_caches(src, num_blocks)
    chunks = [(i * bs, (i + 1) * bs) for i in range(n)]
    rows: dict[str, list[float]] = {name: [] for name in (
        "kvmove save", "kvmove save (exists query)", "vLLM save", "vLLM save (inline)",
        "kvmove save returns",
        "vLLM save returns", "kvmove load", "kvmove load (in the step)",
        "kvmove load (layer-wise)", "vLLM load", "vLLM load (inline)",
        "kvmove load returns", "vLLM load returns")}
    thread = transfer_thread(bs)
    segment = max(1 << 30, 5 * total + (256 << 20))  # a round's objects (removed after it)
    with kvmove.MooncakeStore.embedded(global_segment_size=segment) as store:
        views, _ = block_regions([(f"l{i}", t) for i, t in enumerate(src)], num_blocks)
        mover = block_mover(views, store, staging_slots=n, path=args.path)  # the connector's
        choice = mover.path_choice
        client = store.raw_client  # vLLM's path talks to the same Mooncake client
        store.register([(storage.data_ptr(), storage.nbytes())])
        replicate = ReplicateConfig()

        def keys(tag: str) -> list[str]:
            salt = uuid.uuid4().bytes
            return fmt.keys(ns, [hashlib.sha256(salt + tag.encode() + bytes([i % 256, i // 256]))
                                 .digest() for i in range(n)])

        def check_loaded() -> None:
            for t in src:  # as integers: random bf16 bit patterns hold NaNs, never equal
                bits = t.view(torch.int16)
                assert torch.equal(bits[load_ids], bits[save_ids]), "loaded bytes differ"
                t[load_ids] = 0

        def vllm_save(k):
            exists = client.batch_is_exist(k)
            todo = [i for i, e in enumerate(exists) if e != 1]
            addrs, sizes, _ = vllm.prepare_values([chunks[i] for i in todo],
                                                  [save_ids[i] for i in todo], [0] * len(todo))
            res = client.batch_put_from_multi_buffers([k[i] for i in todo], addrs, sizes,
                                                      replicate)
            assert all(r == 0 for r in res), res[:4]

        def vllm_load(k):
            addrs, sizes, _ = vllm.prepare_values(chunks, load_ids, [0] * n)
            res = client.batch_get_into_multi_buffers(k, addrs, sizes)
            assert res == [object_bytes] * n, res[:4]

        returned: dict[str, float] = {}  # how long the caller's (the engine's) thread waited

        def on_thread(call, k):
            done = threading.Event()
            t0 = time.perf_counter()
            thread.add_request((lambda: call(k), done))
            returned["vLLM"] = time.perf_counter() - t0
            done.wait()

        # As the connector's worker calls the mover: the pages made from the block ids on
        # every call (vLLM's side builds its span lists on every call too).
        def kvmove_save(k, detect_exists):
            t0 = time.perf_counter()
            t = mover.evict(k, block_pages(save_ids), detect_exists=detect_exists)
            if detect_exists is False:  # the connector's save of blocks found absent
                returned["kvmove"] = time.perf_counter() - t0
            assert t.wait() == [kvmove.Status.OK] * n

        def kvmove_load(k, layerwise, background=False):
            t0 = time.perf_counter()
            t = mover.prefetch(k, block_pages(load_ids), layerwise=layerwise)
            if background:  # the connector's asynchronous load: a bounded wait only waits
                returned["kvmove"] = time.perf_counter() - t0
                t.wait(timeout=600)
            if layerwise:
                for layer in range(args.layers):
                    t.wait_layer(layer)
            assert t.wait() == [kvmove.Status.OK] * n
            t.scattered.synchronize()  # the statuses come with the get; the rows after this

        for t in src:
            t[load_ids] = 0
        saves = {"kvmove": lambda k: kvmove_save(k, False),
                 "kvmove (exists query)": lambda k: kvmove_save(k, None),
                 "vLLM": lambda k: on_thread(vllm_save, k), "vLLM (inline)": vllm_save}
        loads = {  # the load -> the save whose objects it reads, and the call
            "kvmove": ("kvmove", lambda k: kvmove_load(k, False, background=True)),
            "kvmove (in the step)": ("kvmove (exists query)", lambda k: kvmove_load(k, False)),
            "vLLM": ("vLLM", lambda k: on_thread(vllm_load, k)),
            "vLLM (inline)": ("vLLM (inline)", vllm_load)}
        rounds, r = args.warmup + args.repeat, 0
        while r < rounds:
            if r == args.warmup:  # quick rounds: more of them, within the time budget
                t_start = time.perf_counter()
            if r == args.warmup + 1:
                took = time.perf_counter() - t_start
                rounds = args.warmup + max(args.repeat, min(args.max_repeat,
                                                            int(args.case_seconds / took)))
            tagged = {who: keys(who) for who in saves}
            order = list(saves)
            order = order[r % len(order):] + order[:r % len(order)]  # each goes first in turn
            times = {}
            for who in order:
                times[_row(who, "save")] = _timed(lambda f=saves[who], k=tagged[who]: f(k))
                if who in returned:
                    times[f"{who} save returns"] = returned.pop(who)
            load_order = list(loads)
            for who in load_order[r % len(loads):] + load_order[:r % len(loads)]:
                saved, f = loads[who]
                times[_row(who, "load")] = _timed(lambda f=f, k=tagged[saved]: f(k))
                check_loaded()
                if who in returned:
                    times[f"{who} load returns"] = returned.pop(who)
            kk = tagged["kvmove"]
            times["kvmove load (layer-wise)"] = _timed(lambda kk=kk: kvmove_load(kk, True))
            check_loaded()
            # vLLM's own objects load through kvmove and the reverse: same bytes.
            kvmove_load(tagged["vLLM"], False)
            check_loaded()
            vllm_load(kk)
            check_loaded()
            store.remove([k for ks in tagged.values() for k in ks], force=True)
            if r >= args.warmup:
                for name, s in times.items():
                    rows[name].append(s)
            r += 1
        mover.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "blocks": n, "layers": args.layers, "heads": args.heads, "block_size": bs,
        "head_dim": args.head_dim, "object_bytes": object_bytes, "total_bytes": total,
        "repeats": len(rows["kvmove save"]), "median_s": med,
        "median_GBps": {k: total / v / 1e9 for k, v in med.items()},
        "spread": {k: (max(v) - min(v)) / statistics.median(v) for k, v in rows.items()},
        "save_ratio": med["vLLM save"] / med["kvmove save"],
        "load_ratio": med["vLLM load"] / med["kvmove load"],
        # the connector's load with load_async off, inside the step
        "load_ratio_in_step": med["vLLM load"] / med["kvmove load (in the step)"],
        # vLLM's time over kvmove's within each repeat (the two ran within milliseconds of
        # each other, so that the load of a shared machine, drifting over seconds, cancels)
        "paired_ratio": {op: _paired(rows[f"vLLM {op}"], rows[f"kvmove {op}"])
                         for op in ("save", "load")},
        # the save of blocks the lookup did not vouch for: the exists query first, as vLLM's
        "save_ratio_exists_query": med["vLLM save"] / med["kvmove save (exists query)"],
        "paired_ratio_exists_query": _paired(rows["vLLM save"],
                                             rows["kvmove save (exists query)"]),
        "inline_ratio": {op: med[f"vLLM {op} (inline)"] / med[f"kvmove {op}"]
                         for op in ("save", "load")},
        "kvmove_path": {"save": choice.evict, "load": choice.prefetch, "why": choice.reason},
        # against the goal: vLLM's calls on its transfer thread, as its connector makes them
        "goal": {op: paired(rows[f"vLLM {op}"], rows[f"kvmove {op}"], GOAL)
                 for op in ("save", "load")},
    }


def _row(who: str, op: str) -> str:
    """"vLLM (inline)", "save" -> "vLLM save (inline)"."""
    name, _, how = who.partition(" ")
    return f"{name} {op}" + (f" {how}" if how else "")


def _paired(theirs: list[float], ours: list[float]) -> dict:
    ratios = [a / b for a, b in zip(theirs, ours, strict=True)]
    q1, q3 = statistics.quantiles(ratios, n=4)[0::2] if len(ratios) > 1 else (ratios[0],) * 2
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3}


def report(result: dict, console) -> None:
    cases = result.get("vllm_cases") or [result["vllm"]]
    for s in cases:
        report_case(s, console)
    table = Table(title=f"kvmove's connector against vLLM's MooncakeStoreConnector path: vLLM's "
                        f"time / kvmove's per repeat, median (quartiles), against >= {GOAL:g}x")
    for col in ("blocks", "MiB", "repeats", "save", "load", "kvmove path (save/load)"):
        table.add_column(col, justify="right")
    for s in cases:
        path = s["kvmove_path"]
        table.add_row(str(s["blocks"]), f"{s['total_bytes'] / 2**20:.2f}", str(s["repeats"]),
                      marked(s["goal"]["save"]), marked(s["goal"]["load"]),
                      f"{path['save']}/{path['load']}")
    console.print(table)
    verdicts = [s["goal"][op]["verdict"] for s in cases for op in ("save", "load")]
    console.print(f"against >= {GOAL:g}x: " + ", ".join(
        f"{verdicts.count(v)} {v}" for v in ("met", "within noise", "missed")))


def report_case(s: dict, console) -> None:
    table = Table(title=f"vLLM connector save/load: {s['blocks']} blocks of "
                        f"{s['object_bytes'] / 1024:.0f} KiB ({s['layers']} layers x "
                        f"{s['heads']} heads x {s['block_size']} tokens x {s['head_dim']} dim, "
                        f"bf16), loopback TCP, median of {s['repeats']}")
    for col in ("path", "median ms", "GB/s", "spread"):
        table.add_column(col, justify="right" if col != "path" else "left")
    for k, v in s["median_s"].items():
        gbps = "-" if k.endswith("returns") else f"{s['median_GBps'][k]:.2f}"
        table.add_row(k, f"{v * 1e3:.2f}", gbps,
                      f"{s['spread'][k] * 100:.0f}%")
    console.print(table)
    console.print(f"kvmove / vLLM (time ratio, > 1 = kvmove faster; vLLM's calls on its "
                  f"transfer thread, as its connector makes them; kvmove's save of new "
                  f"blocks, without the exists query): save {s['save_ratio']:.2f}x, load "
                  f"{s['load_ratio']:.2f}x")
    inline = s.get("inline_ratio")
    if inline:
        console.print(f"against vLLM's calls made inline (no thread): save "
                      f"{inline['save']:.2f}x, load {inline['load']:.2f}x")
    paired = s.get("paired_ratio")
    if paired:
        console.print("the same, per repeat (median of paired ratios, quartiles): " + ", ".join(
            f"{op} {p['median']:.2f}x ({p['q1']:.2f}-{p['q3']:.2f})"
            for op, p in paired.items()))
    if "load_ratio_in_step" in s:
        console.print(f"kvmove's load inside the step (load_async off): "
                      f"{s['load_ratio_in_step']:.2f}x")
    query = s.get("paired_ratio_exists_query")
    if query:
        console.print(f"kvmove's save with the exists query first (blocks not known to be "
                      f"new): {s['save_ratio_exists_query']:.2f}x, paired "
                      f"{query['median']:.2f}x ({query['q1']:.2f}-{query['q3']:.2f})")
    path = s.get("kvmove_path")
    if path:
        console.print(f"kvmove's path: save {path['save']}, load {path['load']} "
                      f"({path['why']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=BLOCK_COUNTS,
                   help="blocks per save/load (one case per count)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=9, help="fewest repeats of a case")
    p.add_argument("--max-repeat", type=int, default=60, help="most repeats of a case")
    p.add_argument("--case-seconds", type=float, default=20.0,
                   help="time budget of a case's repeats (beyond --repeat)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--path", choices=["auto", "staged", "in_place"], default="auto",
                   help="the mover's path (the connector's default: auto)")
    p.add_argument("--quick", action="store_true",
                   help="the same block counts, fewer repeats")
    p.add_argument("--json", nargs="?", const=str(RESULTS / "bench_vllm.json"), default=None,
                   metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.repeat, args.max_repeat, args.case_seconds = 5, 30, 6.0
    result = {
        "benchmark": "bench_vllm", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join(["python -m bench.bench_vllm", *(argv or sys.argv[1:])]),
    }
    result["vllm_cases"] = [bench(args, n) for n in args.blocks]
    # the largest case, as bench.report reads it
    result["vllm"] = max(result["vllm_cases"], key=lambda case: case["blocks"])
    return results.finish_suite(result, report, Path(args.json) if args.json else None)


if __name__ == "__main__":
    sys.exit(main())
