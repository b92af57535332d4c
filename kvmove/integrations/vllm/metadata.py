"""The connector's per-step metadata, built by the scheduler side and read by the worker
side (a vLLM ``KVConnectorMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvmove.integrations.vllm.plan import BlockTransfer


@dataclass
class KVMoveConnectorMetadata(KVConnectorMetadata):
    """What the worker moves in one step (built by the scheduler side). ``save_job``: the
    scheduler's id of this step's saves, whose blocks it holds until every worker reported
    them done (:class:`KVMoveWorkerMetadata`); ``None``: not held, the worker's save returns
    only once its put has read the blocks."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    save_job: int | None = None


@dataclass
class KVMoveWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side after a step: ``done_saves`` maps a save
    job to how many workers finished it (summed over workers by :meth:`aggregate`)."""

    done_saves: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVMoveWorkerMetadata:
        if isinstance(other, KVMoveWorkerMetadata):
            for job, workers in other.done_saves.items():
                self.done_saves[job] = self.done_saves.get(job, 0) + workers
        return self
