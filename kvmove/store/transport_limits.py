"""What one Mooncake client can have in flight, per protocol: the one place kvmove keeps the
transport's limits. The store cuts every batch by them, and the direct path can too. Over
TCP the limit is transfer requests (spans) in flight per (client, peer), not bytes: with a
queue of ``Q`` (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, raised to 65535 by
:func:`prepare_environment` unless the user set it) at most ``min(Q, 8192)`` spans in flight
per client and in one call. Other protocols: 1024 per call and 4096 in flight until
measured; ``StoreConfig.max_call_spans`` / ``max_inflight_spans`` override."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["TCP_QUEUE_VARS", "TransportLimits", "limits_for", "prepare_environment"]

TCP_QUEUE_VARS = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
                  "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER")
TCP_QUEUE_RAISED = 65535  # the variables' maximum
TCP_DEFAULT_QUEUE = 1024  # Mooncake's default for both
TCP_MAX_INFLIGHT = 8192  # spans in flight per client: half of what passed (8 x 2013)
TCP_MAX_CALL = 8192  # spans per call: 8192 x 10 KB put with two replicas in 1.3 s
OTHER_CALL, OTHER_INFLIGHT = 1024, 4096  # not measured
SIDE_BY_SIDE = 1  # calls of one put/get in flight at once (measured over TCP; see above)
# Bytes per call, any protocol: a call must end well inside the store's call_timeout (10 s)
# on a slow link too; 256 MiB is 0.2 s at 10 Gb/s, 2 s at 1 Gb/s. Spans alone do not bound
# it: 8192 spans of a page_first SGLang page (64 tokens x 61 layers x 1152 B: 4.5 MB) are
# 36 GB.
CALL_BYTES = 256 << 20


@dataclass(frozen=True)
class TransportLimits:
    """``call_spans``: spans in one Mooncake call; ``inflight_spans``: spans in flight per
    client, all its calls together; ``basis``: where the figures come from (for logs);
    ``side_by_side``: calls of one put/get in flight at once (within ``inflight_spans``);
    ``call_bytes``: bytes in one Mooncake call (a larger object goes alone)."""

    call_spans: int
    inflight_spans: int
    basis: str
    side_by_side: int = SIDE_BY_SIDE
    call_bytes: int = CALL_BYTES

    def __post_init__(self):
        for name in ("call_spans", "inflight_spans", "side_by_side", "call_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.call_spans > self.inflight_spans:
            object.__setattr__(self, "call_spans", self.inflight_spans)


def prepare_environment(protocol: str, environ: MutableMapping[str, str] | None = None
                        ) -> None:
    """Before a client's ``setup()``: over TCP, raise the per-peer queues to 65535 unless the
    user set them (the client reads them at set-up)."""
    if protocol != "tcp":
        return
    env = os.environ if environ is None else environ
    for var in TCP_QUEUE_VARS:
        if not env.get(var, "").strip():
            env[var] = str(TCP_QUEUE_RAISED)


def _queue(environ) -> int:
    raw = environ.get(TCP_QUEUE_VARS[0], "").strip()
    try:
        value = int(raw) if raw else TCP_DEFAULT_QUEUE
    except ValueError:
        log.warning("%s=%r is not a number; assuming Mooncake's default %d", TCP_QUEUE_VARS[0],
                    raw, TCP_DEFAULT_QUEUE)
        value = TCP_DEFAULT_QUEUE
    return max(1, value)


def limits_for(protocol: str, environ=None, *, call_spans: int | None = None,
               inflight_spans: int | None = None) -> TransportLimits:
    """The limits of a client of ``protocol`` set up under ``environ`` (default: this
    process's environment); ``call_spans`` / ``inflight_spans`` override them."""
    env = os.environ if environ is None else environ
    if protocol == "tcp":
        queue = _queue(env)
        inflight = min(queue, TCP_MAX_INFLIGHT)
        call, basis = min(inflight, TCP_MAX_CALL), f"tcp, per-peer queue {queue} (measured)"
    else:
        call, inflight = OTHER_CALL, OTHER_INFLIGHT
        basis = f"{protocol} (not measured; TCP's order of magnitude)"
    if call_spans is not None or inflight_spans is not None:
        basis += ", overridden by the store config"
    inflight = inflight_spans or inflight
    return TransportLimits(call_spans or min(call, inflight), inflight, basis)
