"""The connector's per-step metadata, built by the scheduler side and read by the worker
side (a vLLM ``KVConnectorMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvmove.integrations.vllm.plan import BlockTransfer


@dataclass
class KVMoveConnectorMetadata(KVConnectorMetadata):
    """What the worker moves in one step (built by the scheduler side)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
