"""kvmove as a vLLM KV connector (V1), sharing objects with vLLM's ``MooncakeStoreConnector``.

Load it by module path::

    --kv-transfer-config '{"kv_connector":"KVMoveConnector",
        "kv_connector_module_path":"kvmove.integrations.vllm","kv_role":"kv_both"}'

One vLLM block is one kvmove row (one page of one token): the KV cache is described as
``kvmove.KVCache`` over vLLM's per-layer block regions (``vllm_layout``), keys are vLLM's
own (``vllm_keys``), and a ``kvmove.KVMover`` with raw keys gathers + puts on save and gets
+ scatters on load. ``kv_connector_extra_config`` accepts ``cache_prefix`` (as vLLM's),
``layerwise`` (default true: loads land layer by layer inside the forward; false: the whole
load ends in ``start_load_kv``) and ``staging_bytes`` (default 1 GiB of staging).

vLLM is imported here only; ``import kvmove`` never imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvmove
from kvmove.integrations.vllm_keys import RankNamespace, VLLMKeyFormat, block_hashes
from kvmove.integrations.vllm_layout import block_regions
from kvmove.integrations.vllm_store import connector_store_config

log = logging.getLogger(__name__)

__all__ = ["KVMoveConnector", "KVMoveConnectorMetadata"]

DEFAULT_STAGING_BYTES = 1 << 30


@dataclass
class BlockTransfer:
    """Blocks to load or save: ``keys[i]`` is the object of vLLM block ``block_ids[i]``."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class KVMoveConnectorMetadata(KVConnectorMetadata):
    """What the worker moves in one step (built by the scheduler side)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


# -- configuration shared by both sides ------------------------------------------------------


@dataclass(frozen=True)
class ConnectorPlan:
    """What both sides agree on: block sizes, key format, ranks and options."""

    block_size: int
    hash_block_size: int
    keys: VLLMKeyFormat
    tp_size: int
    pp_size: int
    replication: int  # TP ranks that hold byte-identical objects (vLLM's replication factor)
    can_load: bool
    can_save: bool
    save_decode: bool  # also save blocks completed during decode (vLLM's save_decode_cache)
    layerwise: bool
    staging_bytes: int

    def lookup_namespaces(self) -> list[RankNamespace]:
        """Every rank namespace that must hold a block before it is a hit."""
        return [RankNamespace(tp_rank=t, pp_rank=p)
                for t in range(self.tp_size // self.replication) for p in range(self.pp_size)]

    def hashes(self, request) -> list[bytes]:
        return block_hashes(request.block_hashes, self.hash_block_size, self.block_size)


def _refuse(what: str) -> ValueError:
    return ValueError(f"KVMoveConnector: {what}. kvmove stores only vLLM's rank-local "
                      f"Mooncake format with one full-attention KV cache group; use vLLM's "
                      f"MooncakeStoreConnector for this configuration")


def plan_from_vllm(vllm_config, kv_cache_config) -> ConnectorPlan:
    """The plan for ``vllm_config``; refuses (``ValueError``) formats kvmove does not cover:
    hybrid / several KV cache groups, TP-sharded store layouts, context parallelism,
    partial hash hits, Mamba state and HiSparse host regions."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    for name in ("store_tp_size", "enable_store_tp_lcm", "prefill_tp_sizes"):
        if extra.get(name) not in (None, False):
            raise _refuse(f"kv_connector_extra_config {name}={extra[name]!r} asks for a "
                          f"TP-sharded store layout")
    if str(extra.get("enable_partial_hash_hits", "false")).lower() == "true":
        raise _refuse("enable_partial_hash_hits is not covered")
    if str(extra.get("enable_cross_layers_blocks", "false")).lower() == "true":
        raise _refuse("enable_cross_layers_blocks is not covered")
    if kv_cache_config is None:
        raise _refuse("vLLM passed no kv_cache_config")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise _refuse(f"the model has {len(groups)} KV cache groups (hybrid)")
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        raise _refuse("HiSparse host-resident KV regions are not covered")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ not in ("FullAttentionSpec", "MLAAttentionSpec"):
        raise _refuse(f"KV cache spec {type(spec).__name__} is not covered")
    par = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(par, name, 1) not in (None, 1):
            raise _refuse(f"{name}={getattr(par, name)} is not covered")
    tp = par.tensor_parallel_size
    num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    replication = tp if isinstance(spec, MLAAttentionSpec) else max(1, tp // num_kv_heads)
    block_size = spec.block_size
    _, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if block_size % hash_block_size:
        raise _refuse(f"block size {block_size} is not a multiple of the hash block size "
                      f"{hash_block_size}")
    role = ktc.kv_role
    save_decode = str(extra.get("save_decode_cache", "false")).lower() == "true"
    staging = extra.get("staging_bytes", DEFAULT_STAGING_BYTES)
    if isinstance(staging, bool) or not isinstance(staging, int) or staging <= 0:
        raise ValueError(f"kv_connector_extra_config staging_bytes must be a positive int, "
                         f"got {staging!r}")
    return ConnectorPlan(
        block_size=block_size,
        hash_block_size=hash_block_size,
        keys=VLLMKeyFormat(
            model_name=VLLMKeyFormat.model_basename(vllm_config.model_config.model),
            group_id=0,
            cache_prefix=str(extra.get("cache_prefix", "")),
        ),
        tp_size=tp,
        pp_size=par.pipeline_parallel_size,
        replication=replication,
        can_load=role in ("kv_consumer", "kv_both"),
        can_save=role in ("kv_producer", "kv_both")
        or save_decode,
        save_decode=save_decode,
        layerwise=str(extra.get("layerwise", "true")).lower() == "true",
        staging_bytes=staging,
    )


# -- the connector ----------------------------------------------------------------------------


class KVMoveConnector(KVConnectorBase_V1):
    """A vLLM KV connector on kvmove. The scheduler side looks up a request's block hashes
    in one batched ``exists`` and schedules loads and saves; the worker side gathers a
    step's new full blocks into staging in one call and puts them in the background, and
    gets + scatters loads (layer by layer inside the forward, or all at once)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.plan = plan_from_vllm(vllm_config, kv_cache_config)
        self._side: _SchedulerSide | _WorkerSide
        if role == KVConnectorRole.SCHEDULER:
            self._side = _SchedulerSide(self.plan)
        else:
            self._side = _WorkerSide(self.plan, vllm_config, kv_cache_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise loads wait inside the forward, between graph pieces.
        return str((extra_config or {}).get("layerwise", "true")).lower() == "true"

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._side.take_load_errors()

    def shutdown(self) -> None:
        self._side.close()

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._side.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._side.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVMoveConnectorMetadata:
        return self._side.build_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        # A save's gather has finished (CPU) or is ordered before vLLM's next use of the
        # blocks (CUDA) by the end of the step that scheduled it: free them at once.
        self._side.forget(request.request_id)
        return False, None


# -- scheduler side ---------------------------------------------------------------------------


@dataclass
class _Request:
    request: Any
    block_ids: list[int]
    saved_blocks: int  # blocks [0, saved_blocks) are in the store or need no save
    load: BlockTransfer | None = None


class _SchedulerSide:
    def __init__(self, plan: ConnectorPlan):
        self.plan = plan
        # The scheduler only asks what exists: it contributes no memory to the store.
        self.store = kvmove.MooncakeStore(connector_store_config().replace(
            global_segment_size=0))
        self._pending: dict[str, tuple[int, int]] = {}  # req -> (computed, hit) tokens
        self._reqs: dict[str, _Request] = {}

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        plan = self.plan
        if not plan.can_load:
            return 0
        bs = plan.block_size
        hashes = plan.hashes(request)[: request.num_tokens // bs]
        first = num_computed_tokens // bs
        if len(hashes) <= first:
            return 0
        namespaces = plan.lookup_namespaces()
        keys = [k for ns in namespaces for k in plan.keys.keys(ns, hashes)]
        try:
            found = list(self.store.exists(keys))
        except Exception as e:  # an unreachable master: no hit, never a failed request
            log.warning("lookup of %d blocks failed: %s", len(hashes), e)
            return 0
        n = len(hashes)
        hit = 0
        while hit < n and all(found[j * n + hit] for j in range(len(namespaces))):
            hit += 1
        hit_tokens = hit * bs
        if hit_tokens >= request.num_tokens:  # vLLM computes at least the last token
            hit_tokens = (request.num_tokens - 1) // bs * bs
        if hit_tokens <= num_computed_tokens:
            return 0
        self._pending[request.request_id] = (num_computed_tokens, hit_tokens)
        return hit_tokens - num_computed_tokens

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        computed, hit = self._pending.pop(request.request_id, (0, 0))
        state = _Request(request, list(block_ids), saved_blocks=0)
        if num_external_tokens > 0:
            bs = self.plan.block_size
            first, end = computed // bs, hit // bs
            # Hash hex only: each worker puts its own rank namespace in front.
            hashes = self.plan.hashes(request)[first:end]
            state.load = BlockTransfer(request.request_id,
                                       [h.hex() for h in hashes],
                                       state.block_ids[first:end])
        self._reqs[request.request_id] = state

    def build_meta(self, out) -> KVMoveConnectorMetadata:
        meta = KVMoveConnectorMetadata()
        bs = self.plan.block_size
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            loaded = new.num_computed_tokens
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            state.saved_blocks = loaded // bs
            self._add_save(meta, state, loaded + scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
                state.saved_blocks = cached.num_computed_tokens[i] // bs
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._add_save(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        return meta

    def _add_save(self, meta: KVMoveConnectorMetadata, state: _Request, computed: int) -> None:
        if not self.plan.can_save:
            return
        hashes = self.plan.hashes(state.request)
        full = min(computed // self.plan.block_size, len(hashes), len(state.block_ids))
        if not self.plan.save_decode:  # as vLLM's connector: the prompt's blocks only
            full = min(full, state.request.num_prompt_tokens // self.plan.block_size)
        if full <= state.saved_blocks:
            return
        first, state.saved_blocks = state.saved_blocks, full
        meta.saves.append(BlockTransfer(state.request.request_id,
                                        [h.hex() for h in hashes[first:full]],
                                        state.block_ids[first:full]))

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._pending.pop(req_id, None)

    # The worker-side methods are not called on this side.
    def close(self) -> None:
        self.store.close()


# -- worker side ------------------------------------------------------------------------------


class _WorkerSide:
    def __init__(self, plan: ConnectorPlan, vllm_config, kv_cache_config):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.plan = plan
        self.kv_cache_config = kv_cache_config
        self.num_blocks = kv_cache_config.num_blocks
        par = vllm_config.parallel_config
        tp_rank = get_tensor_model_parallel_rank()
        self.ranks = RankNamespace(tp_rank=tp_rank // plan.replication,
                                   pp_rank=(par.rank // par.tensor_parallel_size)
                                   % par.pipeline_parallel_size)
        self.key_prefix = plan.keys.prefix(self.ranks) + "@"
        self.store = kvmove.MooncakeStore(connector_store_config())
        self.mover: kvmove.KVMover | None = None
        self.views: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._loads: list[tuple[kvmove.Transfer, list[int]]] = []
        self._saves: list[kvmove.Transfer] = []
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = set(self.kv_cache_config.kv_cache_groups[0].layer_names)
        named = [(n, t) for n, t in kv_caches.items() if n in layers]
        views, self._layer_index = block_regions(named, self.num_blocks)
        self.views = views  # uint8 [num_blocks, block_len] per region, vLLM's order
        kv = kvmove.KVCache({"kv": views})
        object_bytes = sum(v.shape[1] for v in views)
        slots = max(1, min(self.num_blocks, self.plan.staging_bytes // object_bytes))
        self.mover = kvmove.KVMover(kv, self.store, page_tokens=1, staging_slots=slots,
                                    raw_keys=True)
        log.info("kvmove connector: %d regions of %d B per block, %d staging blocks",
                 len(views), views[0].shape[1], slots)

    # -- loads -----------------------------------------------------------------------------
    def start_load(self, meta: KVMoveConnectorMetadata) -> None:
        if not meta.loads or self.mover is None:
            return
        keys = [self.key_prefix + h for t in meta.loads for h in t.keys]
        block_ids = [b for t in meta.loads for b in t.block_ids]
        pages = torch.tensor(block_ids, dtype=torch.int64).unsqueeze(1)
        # More blocks than staging slots run in staging-sized pieces inside the mover.
        transfer = self.mover.prefetch(keys, pages, layerwise=self.plan.layerwise)
        if self.plan.layerwise:
            self._loads.append((transfer, block_ids))
        else:
            self._finish_load(transfer, block_ids)

    def wait_for_layer(self, layer_name: str) -> None:
        if not self._loads:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for transfer, _ in self._loads:
            transfer.wait_layer(layer)

    def _finish_load(self, transfer: kvmove.Transfer, block_ids: list[int]) -> None:
        statuses = transfer.wait()
        transfer.scattered.wait()  # CUDA: vLLM's stream runs after the scatter
        failed = [b for b, s in zip(block_ids, statuses, strict=True) if s is not kvmove.Status.OK]
        if failed:
            log.warning("kvmove connector: %d of %d blocks not loaded (%s); vLLM recomputes "
                        "them", len(failed), len(block_ids),
                        ", ".join(sorted({s.name for s in statuses if s is not kvmove.Status.OK})))
            self._load_errors.update(failed)

    def _finish_loads(self) -> None:
        loads, self._loads = self._loads, []
        for transfer, block_ids in loads:
            self._finish_load(transfer, block_ids)

    def take_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------
    def save(self, meta: KVMoveConnectorMetadata) -> None:
        self._finish_loads()
        self._reap_saves()
        if not meta.saves or self.mover is None:
            return
        keys = [self.key_prefix + h for t in meta.saves for h in t.keys]
        block_ids = [b for t in meta.saves for b in t.block_ids]
        pages = torch.tensor(block_ids, dtype=torch.int64).unsqueeze(1)
        transfer = self.mover.evict(keys, pages)  # in staging-sized pieces where needed
        transfer.gathered.wait()  # CUDA: vLLM reuses the blocks only after the gather
        self._saves.append(transfer)

    def _reap_saves(self, wait: bool = False) -> None:
        keep = []
        for transfer in self._saves:
            if not (wait or transfer.done()):
                keep.append(transfer)
                continue
            statuses = transfer.wait()
            bad = [s for s in statuses if s not in (kvmove.Status.OK, kvmove.Status.EXISTS)]
            if bad:
                log.warning("kvmove connector: %d of %d block saves failed (%s)", len(bad),
                            len(statuses), ", ".join(sorted({s.name for s in bad})))
        self._saves = keep

    def close(self) -> None:
        if self.mover is not None:
            self._finish_loads()
            self._reap_saves(wait=True)
            self.mover.close()
            self.mover = None
        self.store.close()
