"""Turning metrics on and serving them. Off by default: nothing is recorded or exported
until :func:`enable` (or ``KVMOVE_METRICS_PORT``, read by :func:`enable_from_env`)."""

from __future__ import annotations

import os
import threading

from kvmove.metrics import record
from kvmove.metrics.tallies import Tallies

ENV_PORT = "KVMOVE_METRICS_PORT"
_lock = threading.Lock()
_state: dict = {}  # "tallies", "registry", "collector", "server"


def enable(registry=None) -> Tallies:
    """Start recording, exported through ``registry`` (a ``prometheus_client``
    ``CollectorRegistry``; default its global ``REGISTRY``). Idempotent: a second call
    returns the same tallies. Needs the ``metrics`` extra (``prometheus-client``)."""
    try:
        from prometheus_client import REGISTRY
    except ImportError as e:
        raise ImportError("kvmove metrics need prometheus-client: pip install "
                          "'kvmove[metrics]'") from e
    from kvmove.metrics.exposition import TalliesCollector

    with _lock:
        if "tallies" in _state:
            return _state["tallies"]
        tallies = Tallies()
        registry = REGISTRY if registry is None else registry
        collector = TalliesCollector(tallies)
        registry.register(collector)
        _state.update(tallies=tallies, registry=registry, collector=collector)
        record._tallies = tallies
        return tallies


def enabled() -> bool:
    return record._tallies is not None


def disable() -> None:
    """Stop recording, unregister the collector and stop the server (if any)."""
    with _lock:
        record._tallies = None
        if "collector" in _state:
            _state["registry"].unregister(_state["collector"])
        server = _state.get("server")
        if server is not None:
            server[0].shutdown()
            server[0].server_close()
        _state.clear()


def serve(port: int, addr: str = "0.0.0.0") -> int:
    """Enable (if not yet) and serve ``/metrics`` over HTTP on ``port`` (0: a free one) in
    a daemon thread; returns the port bound."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    from prometheus_client import start_http_server

    enable()
    with _lock:
        if "server" in _state:
            return _state["server"][0].server_port
        server, thread = start_http_server(port, addr=addr, registry=_state["registry"])
        _state["server"] = (server, thread)
        return server.server_port


def enable_from_env(environ=None) -> int | None:
    """:func:`serve` on ``$KVMOVE_METRICS_PORT`` where it is set; the port, else None."""
    value = (os.environ if environ is None else environ).get(ENV_PORT, "").strip()
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        raise ValueError(f"{ENV_PORT} must be a port number, got {value!r}") from None
    return serve(port)
