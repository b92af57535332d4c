"""``kvmove master``: a standalone Mooncake master for a cluster of engine processes.

It runs ``mooncake_master`` (an :class:`kvmove.EmbeddedMaster` on the given address and
port) in the foreground, prints the ``MOONCAKE_MASTER=host:port`` line that engine processes
export once the master accepts connections on its own socket, and stops it cleanly on
SIGTERM or SIGINT (Ctrl-C). The master dies with this process (``PR_SET_PDEATHSIG``), so a
supervisor that kills this process leaves no orphan. Mooncake's own log goes to a file whose
path is printed (removed after a clean stop), or to standard error with ``-v``. A port in
use, an address that is not this machine's, or a master that stops on its own end in one
line naming the cause and a non-zero exit. It imports no torch.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time

from kvmove.errors import StoreError
from kvmove.store.embedded_master import DEFAULT_CLIENT_TTL_S, EmbeddedMaster

DEFAULT_PORT = 50051  # Mooncake's own default RPC port
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


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
    if not args.host.strip() or any(c.isspace() for c in args.host):
        parser.error(f"--host must be an address of this machine, got {args.host!r}")


def advertised_host(host: str) -> str:
    """The host engine processes should dial: the bound address, or this machine's name
    when bound to every address."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        return socket.getfqdn() or socket.gethostname()
    return host


def _say(text: str) -> None:
    print(f"kvmove master: {text}", file=sys.stderr, flush=True)


def cause_of(error: StoreError) -> str:
    """One line of a start failure: its first line, and the master's last log line that
    says what went wrong, if any."""
    lines = str(error).splitlines()
    first = lines[0].split("; argv ")[0]
    errors = [ln for ln in lines[1:] if ln[:1] in ("E", "F") or "error" in ln.lower()]
    return first + (f" ({errors[-1].strip()})" if errors else "")


def run_main(args) -> int:
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            master = EmbeddedMaster(
                host=args.host, rpc_port=args.port, metrics_port=args.metrics_port or None,
                client_ttl_s=args.client_ttl, kv_lease_ttl_ms=args.lease_ms,
                extra_args=args.master_args, start_timeout=args.start_timeout,
                stop_timeout=args.grace, log_to_stderr=bool(args.verbose))
        except (StoreError, ValueError) as e:
            _say(cause_of(e) if isinstance(e, StoreError) else str(e))
            return 1
        return _serve(master, args, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve(master: EmbeddedMaster, args, stop: dict) -> int:
    if args.host in LOOPBACK:
        scope = ("loopback only: processes on this machine can reach it, others cannot "
                 "(--host 0.0.0.0 to serve a cluster)")
    else:
        scope = "reachable from other machines: keep the port inside a trusted network"
    print(f"MOONCAKE_MASTER={advertised_host(args.host)}:{args.port}", flush=True)
    _say(f"ready on {args.host}:{args.port} (pid {master.pid}), {scope}")
    if master.log_path is not None:
        _say(f"mooncake_master's log: {master.log_path} (-v shows it here)")
    _say("export the MOONCAKE_MASTER line above in every engine process "
         "(Ctrl-C or SIGTERM stops the master)")
    while stop["signal"] is None and master.running:
        time.sleep(0.1)
    if stop["signal"] is None:  # the master stopped on its own
        code = master.returncode
        master.keep_log = True
        master.stop()
        _say(f"mooncake_master exited by itself with code {code}"
             + (f"; its log: {master.log_path}" if master.log_path else ""))
        return 1
    _say(f"{signal.Signals(stop['signal']).name}: stopping mooncake_master")
    master.stop()
    _say(f"stopped (mooncake_master exit code {master.returncode})")
    return 0
