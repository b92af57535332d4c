"""kvmove as a vLLM KV connector (V1), sharing objects with vLLM's ``MooncakeStoreConnector``.

Load it by module path::

    --kv-transfer-config '{"kv_connector":"KVMoveConnector",
        "kv_connector_module_path":"kvmove.integrations.vllm","kv_role":"kv_both"}'

One vLLM block is one kvmove row; keys are vLLM's own; a ``kvmove.KVMover`` with raw keys
saves and loads. ``kv_connector_extra_config``: ``cache_prefix``, ``load_async``,
``layerwise``, ``staging_bytes``, ``path``, ``tenant``, ``tenant_from_salt``; see
``docs/API.md``, "vLLM", and ``docs/TENANCY.md``. Lookups and saves
follow vLLM's connector (:class:`~kvmove.integrations.vllm.scheduler.SchedulerSide`). vLLM
is imported here only; ``import kvmove`` never imports it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)

from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata
from kvmove.integrations.vllm.plan import loads_wait_in_forward, plan_from_vllm
from kvmove.integrations.vllm.scheduler import SchedulerSide
from kvmove.integrations.vllm.stats import KVMoveConnectorStats, KVMovePromMetrics, StatsSince
from kvmove.integrations.vllm.worker import WorkerSide

__all__ = ["KVMoveConnector"]


def _save_reports(par) -> tuple[int, bool]:
    """How many workers report each save job to this scheduler, and whether they all do
    (else saves hold no blocks and wait for their puts, as before vLLM could hold them).
    Under ``external_launcher`` each engine's scheduler hears its own worker only; with
    pipeline parallelism the stages before the last may report nothing (Ray's compiled
    DAG returns the last stage's outputs; with speculative decoding only the last stage
    saves)."""
    if getattr(par, "distributed_executor_backend", None) == "external_launcher":
        return 1, par.pipeline_parallel_size == 1
    return par.world_size, par.pipeline_parallel_size == 1


class KVMoveConnector(KVConnectorBase_V1):
    """A vLLM KV connector on kvmove. The scheduler side looks up a request's block hashes
    in one batched ``exists`` and schedules loads and saves; the worker side gathers a
    step's new full blocks into staging in one call and puts them in the background, and
    gets + scatters loads (layer by layer inside the forward, or all at once)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        plan = plan_from_vllm(vllm_config, kv_cache_config)
        # Tenant-safe keys (docs/TENANCY.md): the connector's tenant and requests' salts.
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.plan = replace(plan, keys=plan.keys.with_tenant(extra))
        self._side: SchedulerSide | WorkerSide
        self._stats = StatsSince()  # docs/METRICS.md, "vLLM"
        if role == KVConnectorRole.SCHEDULER:
            self._side = SchedulerSide(self.plan, *_save_reports(vllm_config.parallel_config))
        else:
            self._side = WorkerSide(self.plan, vllm_config, kv_cache_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Synchronous layer-wise loads wait inside the forward, between graph pieces.
        return loads_wait_in_forward(extra_config)

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._side.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._side.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # all layers of a block are saved together in wait_for_save

    def wait_for_save(self) -> None:
        self._side.save(self._get_connector_metadata())

    def build_connector_worker_meta(self):
        return self._side.done_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves hold their blocks themselves (request_finished frees at once): no sends.
        return None, (self._side.finished_loads() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._side.take_load_errors()

    def shutdown(self) -> None:
        self._side.close()

    def get_kv_connector_stats(self) -> KVMoveConnectorStats | None:
        return self._stats.take(getattr(self._side, "mover", None))  # the worker's mover

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVMoveConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVMovePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self._side.matched_tokens(request, num_computed_tokens)
        return hit, self.plan.load_async and hit > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._side.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVMoveConnectorMetadata:
        return self._side.build_meta(scheduler_output)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._side.bind_pool(gpu_block_pool)

    def update_connector_output(self, connector_output) -> None:
        self._side.saves_done(connector_output.kv_connector_worker_meta)
        self._side.loads_done(connector_output.finished_recving,
                              connector_output.invalid_block_ids)

    def has_pending_push_work(self) -> bool:
        return self._side.holds_blocks()

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        # The blocks a save still reads are held by its job (SchedulerSide): free the
        # request's at once.
        self._side.forget(request.request_id)
        return False, None
