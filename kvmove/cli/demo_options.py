"""The options of ``kvmove demo`` and their checks. Imports no torch, so that ``kvmove
--help`` stays fast: defaults that depend on the machine (GPU or not) are ``None`` here and
are settled by :func:`settle_defaults` once torch is loaded."""

from __future__ import annotations

import argparse
import os

# Defaults as (with a GPU, without one).
MACHINE_DEFAULTS = {
    "page_tokens": (64, 16),
    "pages": (4096, 400),
    "resident": (1024, 64),
    "topk": (32, 16),
    "steps": (400, 200),
}
PROCESS_DEFAULTS = {"pages": 256, "page_tokens": 16, "layers": 8}


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--layers", type=int, default=None,
                   help="KV layers (default 61, DSA-like; 8 with --processes)")
    p.add_argument("--indexer-layers", type=int, default=None,
                   help="indexer layers (default: same as --layers; 0 = no indexer buffer)")
    p.add_argument("--page-tokens", type=int, default=None,
                   help="tokens per page (default 64 with a GPU, 16 without)")
    p.add_argument("--pages", type=int, default=None,
                   help="logical pages in the sequence (default 4096 with a GPU, 400 without; "
                        "256 with --processes)")
    p.add_argument("--resident", type=int, default=None,
                   help="pages that fit in the device hot buffer (default 1024 with a GPU, "
                        "64 without)")
    p.add_argument("--topk", type=int, default=None,
                   help="pages attention selects per step (default 32 with a GPU, 16 without)")
    p.add_argument("--steps", type=int, default=None,
                   help="decode steps (default 400 with a GPU, 200 without)")
    p.add_argument("--staging-slots", type=int, default=None,
                   help="staging pages, at least --topk (default: enough for one step)")
    p.add_argument("--backend", choices=["auto", "triton", "torch", "two_hop"], default="auto",
                   help="row-copy backend (auto: Triton on CUDA, torch on the CPU)")
    p.add_argument("--path", choices=["auto", "staged", "in_place"], default="auto",
                   help="how pages move: through staging, or the store reading and writing "
                        "the KV rows in place (auto: the faster, measured)")
    p.add_argument("--layerwise", action="store_true",
                   help="prefetch layer by layer (wait_layer) instead of all layers at once")
    p.add_argument("--master", default=None,
                   help="host:port of an existing Mooncake master (other settings from "
                        "MOONCAKE_* variables); default: $MOONCAKE_MASTER, else an embedded "
                        "master")
    p.add_argument("--processes", type=int, default=1,
                   help="engine processes (default 1). 2 or more: the prefill/decode shape, "
                        "one process evicts the pages it prefilled and the others prefetch "
                        "and verify them through one master")
    p.add_argument("--direct", action="store_true",
                   help="with --processes 2 or more: no store; the prefill process streams "
                        "its pages layer by layer straight into the decode processes' "
                        "layer-first host pools (PageSender / PageReceiver)")
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas of every stored page (default 1; see README 'Clusters')")
    p.add_argument("--seed", type=int, default=0, help="seed of the top-k selection")
    p.add_argument("--device", default=None,
                   help="torch device of the KV cache (default cuda with a GPU, else cpu)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve kvmove's Prometheus metrics on http://HOST:PORT/metrics during "
                        "the run (0: a free port, printed; default $KVMOVE_METRICS_PORT, else "
                        "none; needs the metrics extra; see docs/METRICS.md)")
    p.add_argument("--metrics-linger", type=float, default=0.0,
                   help="with --metrics-port: keep serving this many seconds after the run "
                        "(for a last scrape)")
    return p


def check(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (a one-line message naming the option, exit 2) for values the demo
    cannot run with. Values still ``None`` are checked after :func:`settle_defaults`."""
    positive = ("layers", "page_tokens", "pages", "resident", "topk", "processes", "replicas")
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("indexer_layers", "steps"):
        value = getattr(args, name)
        if value is not None and value < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if args.metrics_port is not None and args.processes > 1:
        parser.error("--metrics-port applies to the single-process demo (--processes 1)")
    port_env = os.environ.get("KVMOVE_METRICS_PORT", "").strip()
    if args.metrics_port is None and port_env and not (
            port_env.isdigit() and int(port_env) <= 65535):
        parser.error(f"KVMOVE_METRICS_PORT must be a port number (0..65535), got {port_env!r}")
    if args.metrics_linger < 0 or args.metrics_linger != args.metrics_linger:
        parser.error(f"--metrics-linger must not be negative, got {args.metrics_linger}")
    if args.processes > 64:
        parser.error(f"--processes must be at most 64, got {args.processes}")
    if args.direct and args.processes < 2:
        parser.error("--direct needs --processes 2 or more (a prefill process and decode "
                     "processes)")
    if args.direct and (args.master is not None or args.replicas != 1):
        parser.error("--direct moves pages without a store: --master and --replicas do not "
                     "apply")
    if args.layerwise and args.processes > 1:
        parser.error("--layerwise applies to the single-process demo (--processes 1)")
    if args.resident is not None and args.resident < 2 and args.processes == 1:
        parser.error(f"--resident must be at least 2 (the tail page and one more), "
                     f"got {args.resident}")
    if (args.topk is not None and args.resident is not None and args.processes == 1
            and args.topk >= args.resident):
        parser.error(f"--topk ({args.topk}) must be less than --resident ({args.resident}): "
                     f"the selected pages and the tail page must all be resident")
    if args.staging_slots is not None:
        topk = args.topk if args.topk is not None else 1
        if args.staging_slots < topk:
            parser.error(f"--staging-slots must be at least --topk ({topk}): one step moves "
                         f"up to --topk pages at once, got {args.staging_slots}")
    check_store_settings(parser, args)


def check_store_settings(parser: argparse.ArgumentParser, args) -> None:
    """The master: ``--master``, else ``MOONCAKE_MASTER``, else an embedded one (``args.master``
    None). Every ``MOONCAKE_*`` variable is checked now, so a typo is one line, exit 2,
    before anything waits."""
    from kvmove.store.config import StoreConfig

    if args.master is not None:
        try:
            StoreConfig(master_address=args.master)
        except ValueError as e:
            parser.error(f"--master: {e}")
    elif os.environ.get("MOONCAKE_MASTER", "").strip():
        args.master = os.environ["MOONCAKE_MASTER"].strip()
    try:
        StoreConfig.from_env(master_address=args.master or "127.0.0.1:1")
    except ValueError as e:
        parser.error(str(e))


def settle_defaults(parser: argparse.ArgumentParser, args, on_gpu: bool) -> None:
    """Fill the machine-dependent defaults, then check again. A default never overrules a
    value given: ``--topk 100`` alone raises the default ``--resident`` to fit it."""
    given = {name for name in MACHINE_DEFAULTS if getattr(args, name) is not None}
    for name, (gpu, cpu) in MACHINE_DEFAULTS.items():
        if getattr(args, name) is None:
            value = PROCESS_DEFAULTS.get(name) if args.processes > 1 else None
            setattr(args, name, value or (gpu if on_gpu else cpu))
    if args.layers is None:
        args.layers = PROCESS_DEFAULTS["layers"] if args.processes > 1 else 61
    if args.processes == 1 and args.topk >= args.resident:
        if "resident" not in given:
            args.resident = args.topk + 1
        elif "topk" not in given:
            args.topk = max(1, args.resident - 1)
    check(parser, args)
