"""What both sides of the vLLM connector agree on (:class:`ConnectorPlan`: block sizes, key
format, ranks, options), read from vLLM's config, and what one step moves
(:class:`BlockTransfer`). vLLM is imported only inside :func:`plan_from_vllm`."""

from __future__ import annotations

from dataclasses import dataclass

from kvmove.integrations.vllm.keys import RankNamespace, VLLMKeyFormat, block_hashes

DEFAULT_STAGING_BYTES = 1 << 30


@dataclass
class BlockTransfer:
    """Blocks to load or save: ``keys[i]`` is the object of vLLM block ``block_ids[i]``, the
    block at position ``first_block + i`` in its request (block 0 holds tokens ``0 ..
    block_size - 1``). ``absent_at_lookup`` (saves): the scheduler's lookup of the request
    found none of these blocks in the store."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    first_block: int = 0
    absent_at_lookup: bool = False

    def positions(self) -> range:
        """The position in its request of each block."""
        return range(self.first_block, self.first_block + len(self.block_ids))


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
    layerwise: bool  # synchronous loads land layer by layer inside the forward
    staging_bytes: int
    # loads run in the background while the engine steps on; the request waits for its
    # blocks (vLLM's WAITING_FOR_REMOTE_KVS) and is scheduled once they are in, as vLLM's
    # own connector does (its load_async, default true). Off: a load ends in its step.
    load_async: bool
    path: str = "auto"  # KVMover's path: "auto" (measured per direction), "staged", "in_place"
    # EAGLE-like speculative decoding: a store hit drops its last block, as vLLM's prefix
    # cache and its connector do (that block's draft KV was made with the next token)
    eagle_block_drop: bool = False

    def saves_block(self, tp_rank: int, position: int) -> bool:
        """Whether TP rank ``tp_rank`` saves the block at ``position`` in its request. Ranks
        that hold byte-identical blocks (``replication`` of them: MLA, GQA with fewer KV
        heads than TP ranks) share one key namespace and take turns, as vLLM's
        ``MooncakeStoreConnector`` does (its ``group_put_steps``): rank ``r`` puts block
        ``i`` when ``i % replication == (r + group) % replication``, so each block is put
        once. Every rank loads every block."""
        step = self.replication
        return position % step == (tp_rank + self.keys.group_id) % step

    def lookup_namespaces(self) -> list[RankNamespace]:
        """Every rank namespace that must hold a block before it is a hit."""
        return [RankNamespace(tp_rank=t, pp_rank=p)
                for t in range(self.tp_size // self.replication) for p in range(self.pp_size)]

    def hashes(self, request) -> list[bytes]:
        return block_hashes(request.block_hashes, self.hash_block_size, self.block_size)


def _flag(extra: dict, name: str, default: bool) -> bool:
    """A true/false option of ``kv_connector_extra_config`` (a bool or its string, as vLLM's
    connector reads them)."""
    return str(extra.get(name, default)).lower() == "true"


def loads_wait_in_forward(extra: dict | None) -> bool:
    """Whether loads land layer by layer inside the forward (``wait_for_layer_load``): only
    where they were asked to be synchronous (``load_async`` false) and ``layerwise`` (its
    default). Read from the extra config alone, as vLLM asks the connector class before
    it is built (``requires_piecewise_for_cudagraph``); where loads were asked to be
    asynchronous but run in the step all the same (pipeline parallelism, lockstep ranks),
    they end whole in ``start_load_kv``, before the forward."""
    extra = extra or {}
    return _flag(extra, "layerwise", True) and not _flag(extra, "load_async", True)


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
    if _flag(extra, "enable_partial_hash_hits", False):
        raise _refuse("enable_partial_hash_hits is not covered")
    if _flag(extra, "enable_cross_layers_blocks", False):
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
    load_async = _flag(extra, "load_async", True)
    # Under external_launcher each rank's scheduler hears its own worker only: with async
    # loads, ranks would admit a request at different steps, and their batches (and
    # collectives) part ways. Synchronous loads keep them in lockstep.
    lockstep = (getattr(par, "distributed_executor_backend", None) == "external_launcher"
                and getattr(par, "world_size", 1) > 1)
    save_decode = _flag(extra, "save_decode_cache", False)
    staging = extra.get("staging_bytes", DEFAULT_STAGING_BYTES)
    if isinstance(staging, bool) or not isinstance(staging, int) or staging <= 0:
        raise ValueError(f"kv_connector_extra_config staging_bytes must be a positive int, "
                         f"got {staging!r}")
    path = str(extra.get("path", "auto"))
    if path not in ("auto", "staged", "in_place"):
        raise ValueError(f"kv_connector_extra_config path must be 'auto', 'staged' or "
                         f"'in_place', got {path!r}")
    speculative = getattr(vllm_config, "speculative_config", None)
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
        # An asynchronous load is over once every worker reported it; with pipeline
        # parallelism the stages before the last may report nothing (see the connector's
        # _save_reports): their loads run inside the step instead (as in lockstep).
        layerwise=loads_wait_in_forward(extra),
        load_async=load_async and par.pipeline_parallel_size == 1 and not lockstep,
        staging_bytes=staging,
        path=path,
        eagle_block_drop=speculative is not None and speculative.use_eagle_block_drop(),
    )
