"""``kvmove master``: a standalone Mooncake master for a cluster of engine processes.

It runs ``mooncake_master`` in the foreground with its log on standard error, prints the
``MOONCAKE_MASTER=host:port`` line that engine processes export once the master accepts
connections, and stops it cleanly on SIGTERM or SIGINT (Ctrl-C): SIGTERM to the master,
SIGKILL after a grace time. The master dies with this process (``PR_SET_PDEATHSIG``), so a
supervisor that kills this process leaves no orphan. It imports no torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from kvmove.errors import StoreError
from kvmove.store.embedded_master import (
    DEFAULT_CLIENT_TTL_S,
    _die_with_parent,
    _free_ports,
    find_master_binary,
    master_argv,
    tcp_reachable,
)

DEFAULT_PORT = 50051  # Mooncake's own default RPC port
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; "
                             "0.0.0.0 or this machine's address for other machines)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"RPC port (default {DEFAULT_PORT}, Mooncake's)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="HTTP metrics port (default: a free port)")
    parser.add_argument("--client-ttl", type=int, default=DEFAULT_CLIENT_TTL_S,
                        help="seconds without a heartbeat before the master drops a client "
                             "and the replicas on its memory (default "
                             f"{DEFAULT_CLIENT_TTL_S}; Mooncake's own is 10)")
    parser.add_argument("--lease-ms", type=int, default=None,
                        help="milliseconds a read protects an object from removal "
                             "(Mooncake's default 10000)")
    parser.add_argument("--start-timeout", type=float, default=15.0,
                        help="seconds to wait for the master to accept connections")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping")
    parser.add_argument("master_args", nargs="*", metavar="-- FLAG",
                        help="more mooncake_master flags, after '--' (e.g. -- --v=1)")
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (one line, exit 2) for a value that cannot work."""
    for name in ("port", "metrics_port"):
        value = getattr(args, name)
        low = 1 if name == "port" else 0
        if not low <= value <= 65535:
            parser.error(f"--{name.replace('_', '-')} must be in {low}..65535, got {value}")
    if args.client_ttl < 1:
        parser.error(f"--client-ttl must be at least 1 second, got {args.client_ttl}")
    if args.lease_ms is not None and args.lease_ms < 1:
        parser.error(f"--lease-ms must be positive, got {args.lease_ms}")
    if not args.start_timeout > 0 or not args.grace > 0:
        parser.error("--start-timeout and --grace must be positive seconds")


def advertised_host(host: str) -> str:
    """The host engine processes should dial: the bound address, or this machine's name
    when bound to every address."""
    if host in ("0.0.0.0", "::", ""):
        return socket.getfqdn() or socket.gethostname()
    return host


def run_main(args) -> int:
    try:
        binary = find_master_binary()
    except StoreError as e:
        print(f"kvmove master: {e}", file=sys.stderr)
        return 1
    metrics_port = args.metrics_port or _free_ports(
        "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host, 1)[0]
    argv = master_argv(binary, host=args.host, rpc_port=args.port, metrics_port=metrics_port,
                       client_ttl_s=args.client_ttl, kv_lease_ttl_ms=args.lease_ms,
                       extra_args=args.master_args)
    if args.host in LOOPBACK:
        scope = "loopback only: processes on this machine can reach it, others cannot " \
                "(--host 0.0.0.0 to serve a cluster)"
    else:
        scope = "reachable from other machines: keep the port inside a trusted network"
    print(f"kvmove master: starting {' '.join(argv)}", file=sys.stderr, flush=True)
    print(f"kvmove master: binding {args.host}:{args.port}, {scope}", file=sys.stderr,
          flush=True)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent(os.getpid()))
        return _supervise(proc, args, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(proc: subprocess.Popen, args, stop: dict) -> int:
    dial = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host.strip("[]")
    deadline = time.monotonic() + args.start_timeout
    ready = False
    while stop["signal"] is None:
        code = proc.poll()
        if code is not None:
            print(f"kvmove master: mooncake_master exited with code {code}"
                  + ("" if ready else f" before accepting connections on port {args.port} "
                     "(is the port in use?)"), file=sys.stderr, flush=True)
            return code or 1
        if not ready:
            if tcp_reachable(dial, args.port, 0.2):
                ready = True
                print(f"MOONCAKE_MASTER={advertised_host(args.host)}:{args.port}", flush=True)
                print("kvmove master: ready; export the line above in every engine process "
                      "(Ctrl-C or SIGTERM stops the master)", file=sys.stderr, flush=True)
            elif time.monotonic() > deadline:
                print(f"kvmove master: no connection on {dial}:{args.port} within "
                      f"{args.start_timeout:g}s; stopping", file=sys.stderr, flush=True)
                _stop(proc, args.grace)
                return 1
            else:
                time.sleep(0.05)
                continue
        time.sleep(0.1)
    name = signal.Signals(stop["signal"]).name
    print(f"kvmove master: {name}: stopping mooncake_master", file=sys.stderr, flush=True)
    code = _stop(proc, args.grace)
    print(f"kvmove master: stopped (mooncake_master exit code {code})", file=sys.stderr,
          flush=True)
    return 0


def _stop(proc: subprocess.Popen, grace: float) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            print(f"kvmove master: mooncake_master ignored SIGTERM for {grace:g}s; killing it",
                  file=sys.stderr, flush=True)
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode
