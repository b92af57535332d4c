"""End-to-end benchmark of the HiSparse paths: ``KVMover.evict`` (gather + put) and
``KVMover.prefetch`` (get + scatter) of a DSA-like hybrid cache (kv 656-byte rows and an
indexer of 132-byte rows per layer), against the sum of their parts measured in the same run
(``gather`` alone, ``store.put`` alone, ...), the raw contiguous Mooncake put/get of the same
bytes, the mover with end-to-end checksums on (its overhead), and the plain mover's evict with
a store whose ``begin_put`` starts nothing (the exists check inside the put, not started
while the gather ends and the descriptors are made).

    python -m bench.bench_mover                  # table
    python -m bench.bench_mover --json out.json  # and the figures as JSON
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import kvmove
from bench import results


def build_parser() -> argparse.ArgumentParser:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench.bench_mover", description=__doc__)
    p.add_argument("--layers", type=int, default=61 if on_gpu else 16)
    p.add_argument("--page-tokens", type=int, default=64 if on_gpu else 16)
    p.add_argument("--pages", type=int, default=256 if on_gpu else 64, help="pages per call")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="fewer layers, pages and repeats")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    return p


class PlainPut:
    """A begun put that started nothing: its put is the store's plain put."""

    def __init__(self, store, detect_exists: bool | None):
        self._store, self._detect_exists = store, detect_exists

    def put(self, desc):
        return self._store.put(desc, detect_exists=self._detect_exists)

    def close(self) -> None:
        pass

    def __enter__(self) -> PlainPut:
        return self

    def __exit__(self, *exc) -> None:
        pass


class PlainPutStore:
    """``store`` (a :class:`kvmove.store.protocol.Store`) whose ``begin_put`` starts
    nothing: a mover on it puts plainly, the exists check made inside the put. Every other
    call is the store's own; ``close`` is left to the store's owner."""

    def __init__(self, store):
        self._store = store

    @property
    def transport(self):
        return self._store.transport

    @property
    def address(self) -> str:
        return self._store.address

    def register(self, staging) -> None:
        self._store.register(staging)

    def unregister(self, staging) -> None:
        self._store.unregister(staging)

    def put(self, desc, *, detect_exists=None, until_returned=False):
        return self._store.put(desc, detect_exists=detect_exists,
                               until_returned=until_returned)

    def begin_put(self, keys, *, detect_exists=None) -> PlainPut:
        return PlainPut(self._store, detect_exists)

    def get(self, desc, *, until_returned=False):
        return self._store.get(desc, until_returned=until_returned)

    def exists(self, keys):
        return self._store.exists(keys)

    def remove(self, keys, *, force=False):
        return self._store.remove(keys, force=force)

    def close(self) -> None:
        pass


def make_cache(args) -> kvmove.KVCache:
    slots = 2 * args.pages * args.page_tokens
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (args.layers, slots, 656), dtype=torch.uint8, generator=g)
    ix = torch.randint(0, 256, (args.layers, slots, 132), dtype=torch.uint8, generator=g)
    return kvmove.KVCache({"kv": kv.to(args.device), "indexer": ix.to(args.device)})


def run(args) -> dict:
    kv = make_cache(args)
    n, p = args.pages, args.page_tokens
    src = torch.arange(n * p).reshape(n, p)
    dst = src + n * p
    samples: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        samples.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    with kvmove.MooncakeStore.embedded(global_segment_size=2 << 30) as store:
        movers = {
            "plain": kvmove.KVMover(kv, store, page_tokens=p, staging_slots=n,
                                    key_prefix="bench"),
            "checksum": kvmove.KVMover(kv, store, page_tokens=p, staging_slots=n,
                                       key_prefix="bench", checksum=True),
        }
        plain = movers["plain"]
        # the plain mover's twin on a store whose begin_put starts nothing (the one
        # difference): its evicts make the exists check inside the put
        plain_put = kvmove.KVMover(kv, PlainPutStore(store), page_tokens=p, staging_slots=n,
                                   key_prefix="bench")
        object_bytes = plain.staging.object_bytes
        total = n * object_bytes
        # The raw baseline: the same bytes, one contiguous span per key.
        flat = torch.randint(0, 256, (total,), dtype=torch.uint8)
        flat_back = torch.zeros_like(flat)
        store.register([(flat.data_ptr(), flat.numel()), (flat_back.data_ptr(), total)])
        client = store.raw_client
        raw_src = [flat.data_ptr() + i * object_bytes for i in range(n)]
        raw_dst = [flat_back.data_ptr() + i * object_bytes for i in range(n)]
        sizes = [object_bytes] * n
        def evict_with_plain_put(put_keys):
            """The plain mover's evict with the exists check made inside the put."""
            statuses = timed("evict (check in put)",
                             lambda: plain_put.evict(put_keys, src).wait())
            assert all(s is kvmove.Status.OK for s in statuses), statuses[:3]

        for r in range(args.repeat + 1):  # the first round warms up and is dropped
            keys = [f"{uuid.uuid4().hex[:10]}-{i}" for i in range(n)]
            put_keys = [f"put-{k}" for k in keys]
            if r % 2:  # before the plain mover's own evict by turns
                evict_with_plain_put(put_keys)
            for name, mover in movers.items():
                statuses = timed(f"evict ({name})",
                                 lambda m=mover, k=keys: m.evict(k, src).wait())
                assert all(s is kvmove.Status.OK for s in statuses), statuses[:3]
                statuses = timed(f"prefetch ({name})",
                                 lambda m=mover, k=keys: m.prefetch(k, dst).wait())
                assert all(s is kvmove.Status.OK for s in statuses), statuses[:3]
            if not r % 2:
                evict_with_plain_put(put_keys)
            # The parts of the plain path, on the plain mover's staging.
            slots = plain.staging.alloc(n)
            try:
                timed("gather", lambda s=slots: kvmove.gather(kv, plain.staging, src, s))
                part_keys = [f"part-{k}" for k in keys]
                desc = timed("describe",
                             lambda s=slots, k=part_keys: kvmove.describe(plain.staging, s, k))
                assert timed("store.put", lambda d=desc: store.put(d)).all_ok  # as the mover
                assert timed("store.get", lambda d=desc: store.get(d)).all_ok
                timed("scatter", lambda s=slots: kvmove.scatter(plain.staging, s, kv, dst))
            finally:
                plain.staging.free(slots)
            raw_keys = [f"raw-{k}" for k in keys]
            codes = timed("raw put", lambda k=raw_keys: client.batch_put_from(k, raw_src, sizes))
            assert all(c == 0 for c in codes)
            codes = timed("raw get", lambda k=raw_keys: client.batch_get_into(k, raw_dst, sizes))
            assert codes == sizes
            for m in movers.values():
                store.remove(m.keyspace.store_keys(keys), force=True)
            store.remove(plain_put.keyspace.store_keys(put_keys), force=True)
            store.remove(part_keys + raw_keys, force=True)
            if r == 0:
                samples.clear()
        path = {"evict": plain.path_choice.evict, "prefetch": plain.path_choice.prefetch,
                "why": plain.path_choice.reason}
        for m in (*movers.values(), plain_put):
            m.close()
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in samples.items()}
    seconds = {k: statistics.median(v) for k, v in samples.items()}
    # The parts each path is made of, timed apart: describing the keys is one of them.
    parts_evict = total / (seconds["gather"] + seconds["describe"] + seconds["store.put"]) / 1e9
    parts_prefetch = total / (seconds["describe"] + seconds["store.get"] + seconds["scatter"]) \
        / 1e9
    return {
        "device": args.device, "layers": args.layers, "page_tokens": p, "pages": n,
        "path": path,
        "object_bytes": object_bytes, "total_bytes": total, "repeats": args.repeat,
        "median_GBps": gbps,
        "ratios": {
            "evict / (gather, describe, put)": gbps["evict (plain)"] / parts_evict,
            "prefetch / (describe, get, scatter)": gbps["prefetch (plain)"] / parts_prefetch,
            "evict / raw put": gbps["evict (plain)"] / gbps["raw put"],
            "prefetch / raw get": gbps["prefetch (plain)"] / gbps["raw get"],
            "evict with checksum / without": gbps["evict (checksum)"] / gbps["evict (plain)"],
            "prefetch with checksum / without":
                gbps["prefetch (checksum)"] / gbps["prefetch (plain)"],
            "evict, exists check begun early / in the put":
                gbps["evict (plain)"] / gbps["evict (check in put)"],
        },
    }


def report(result: dict, console: Console) -> None:
    table = Table(title=f"KVMover end to end: {result['pages']} pages x "
                        f"{result['object_bytes'] / 2**20:.2f} MiB per call "
                        f"({result['layers']} layers, {result['device']})")
    table.add_column("method")
    table.add_column("GB/s (median)", justify="right")
    for name, value in result["median_GBps"].items():
        table.add_row(name, f"{value:.2f}")
    console.print(table)
    ratios = Table(title="ratios (same run)")
    ratios.add_column("comparison")
    ratios.add_column("ratio", justify="right")
    for name, value in result["ratios"].items():
        ratios.add_row(name, f"{value:.2f}x")
    console.print(ratios)
    path = result.get("path")
    if path:
        console.print(f"the movers' path: evict {path['evict']}, prefetch {path['prefetch']} "
                      f"({path['why']})")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.layers, args.pages, args.repeat = min(args.layers, 8), min(args.pages, 32), 3
    return results.finish_suite(run(args), report, args.json)


if __name__ == "__main__":
    sys.exit(main())
