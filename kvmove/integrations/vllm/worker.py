"""The vLLM connector's worker side: vLLM's KV cache as a :class:`kvmove.KVCache` of block
regions (:mod:`.layout`), and a :class:`kvmove.KVMover` with raw keys that saves a step's
blocks (gather + put, or a put straight from the blocks) and loads them (get + scatter, or a
get straight into the blocks), whichever path the mover measured faster."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

import kvmove
from kvmove.integrations.vllm.keys import RankNamespace
from kvmove.integrations.vllm.layout import block_regions
from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata, KVMoveWorkerMetadata
from kvmove.integrations.vllm.plan import ConnectorPlan
from kvmove.integrations.vllm.store_config import connector_store_config

if TYPE_CHECKING:
    from kvmove.store.protocol import Store

log = logging.getLogger(__name__)


def block_mover(views: list[torch.Tensor], store: Store, *, staging_slots: int,
                path: str = "auto") -> kvmove.KVMover:
    """The connector's :class:`kvmove.KVMover` over vLLM's block regions ``views`` (uint8
    ``[num_blocks, block_len]`` each, :func:`.layout.block_regions`): one-token pages (a
    page is a block), raw (vLLM) keys. ``path="auto"``: where the store reaches vLLM's blocks
    (host memory; device memory over RDMA) and moving them in place measures faster, saves
    and loads skip staging. A load lands in blocks vLLM allocated for it and a block whose
    load failed is recomputed (``kv_load_failure_policy`` "recompute"): whatever a failed
    in-place get left in it is overwritten, so loads go in place too (the default,
    ``keep_failed_rows=False``). A put in place runs in the background
    (``put_in_background=True``): vLLM's scheduler holds the blocks until it is done."""
    return kvmove.KVMover(kvmove.KVCache({"kv": views}), store, page_tokens=1,
                          staging_slots=staging_slots, raw_keys=True, path=path,
                          put_in_background=True)


def block_pages(block_ids: list[int]) -> np.ndarray:
    """vLLM block ids as the mover's one-token pages: a numpy int64 ``[n, 1]``, which the
    mover takes as it is. ``torch.tensor`` of a list costs about twice as much per step
    (measured cold, as after a step's transfer: ~150 µs against ~75 µs for 256 blocks), and
    a tensor made from the array another ~16 µs cold."""
    return np.array(block_ids, dtype=np.int64).reshape(-1, 1)


def unique_rounds(keys: list[str]) -> list[list[int]]:
    """Positions of ``keys`` in rounds of unique keys: round ``r`` holds the positions of
    each key's occurrence ``r`` (counted from 0), in order. No key repeats: one round."""
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}  # key -> how often it came so far
    for i, key in enumerate(keys):
        r = seen.get(key, 0)
        seen[key] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds


class WorkerSide:
    """The connector's worker side: a :class:`kvmove.KVMover` over vLLM's block regions;
    one gather + background put per step's saves, get + scatter per step's loads."""

    def __init__(self, plan: ConnectorPlan, vllm_config, kv_cache_config):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.plan = plan
        self.kv_cache_config = kv_cache_config
        self.num_blocks = kv_cache_config.num_blocks
        par = vllm_config.parallel_config
        tp_rank = self.tp_rank = get_tensor_model_parallel_rank()
        self.ranks = RankNamespace(tp_rank=tp_rank // plan.replication,
                                   pp_rank=(par.rank // par.tensor_parallel_size)
                                   % par.pipeline_parallel_size)
        self.key_prefix = plan.keys.prefix(self.ranks) + "@"
        self.store: Store = kvmove.MooncakeStore(connector_store_config())
        self.mover: kvmove.KVMover | None = None
        self.views: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._loads: list[tuple[kvmove.Transfer, list[int]]] = []  # layer-wise, this step
        # asynchronous loads in flight: a step's prefetches and the requests they load
        self._recving: list[tuple[list[tuple[kvmove.Transfer, list[int]]], set[str]]] = []
        self._saves: list[kvmove.Transfer] = []
        self._save_jobs: list[tuple[int, kvmove.Transfer | None]] = []  # not reported yet
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = set(self.kv_cache_config.kv_cache_groups[0].layer_names)
        named = [(n, t) for n, t in kv_caches.items() if n in layers]
        views, self._layer_index = block_regions(named, self.num_blocks)
        self.views = views  # uint8 [num_blocks, block_len] per region, vLLM's order
        object_bytes = sum(v.shape[1] for v in views)
        slots = max(1, min(self.num_blocks, self.plan.staging_bytes // object_bytes))
        self.mover = block_mover(views, self.store, staging_slots=slots, path=self.plan.path)
        choice = self.mover.path_choice
        log.info("kvmove connector: %d regions of %d B per block, %d staging blocks; saves "
                 "%s, loads %s (%s)", len(views), views[0].shape[1],
                 self.mover.staging.num_slots, choice.evict, choice.prefetch, choice.reason)

    # -- loads -----------------------------------------------------------------------------
    def start_load(self, meta: KVMoveConnectorMetadata) -> None:
        """Start the step's loads. Synchronous (``plan.load_async`` off): layer by layer
        (``wait_for_layer``) or whole, ended here. Asynchronous: in the background, each
        request reported by :meth:`finished_loads` once its blocks are in (or failed)."""
        if not meta.loads:
            return
        if self.plan.load_async:
            self._start_async(meta)
            return
        if self.mover is None:  # nothing can land: vLLM recomputes the blocks
            self._load_errors.update(b for t in meta.loads for b in t.block_ids)
            return
        loads = [(self.mover.prefetch(keys, block_pages(ids), layerwise=self.plan.layerwise),
                  ids) for keys, ids in self._rounds(meta)]
        if self.plan.layerwise:
            self._loads.extend(loads)
        else:
            for transfer, ids in loads:
                self._finish_load(transfer, ids)

    def _rounds(self, meta: KVMoveConnectorMetadata) -> list[tuple[list[str], list[int]]]:
        """The step's loads as rounds of unique keys, one prefetch each (a prefetch's keys
        are unique, but two requests with the same prefix, vLLM's prefix cache off, load
        the same key into blocks of their own): per round its keys and block ids. More
        blocks than staging slots run in staging-sized pieces inside the mover."""
        keys = [self.key_prefix + h for t in meta.loads for h in t.keys]
        block_ids = [b for t in meta.loads for b in t.block_ids]
        return [([keys[i] for i in positions], [block_ids[i] for i in positions])
                for positions in unique_rounds(keys)]

    def _start_async(self, meta: KVMoveConnectorMetadata) -> None:
        """Start the step's loads in the background. A round that cannot start fails its
        blocks (vLLM recomputes them, reported at once); its requests are reported finished
        all the same once the rounds started before it have ended (they may still write
        their blocks), or they would wait for their blocks forever."""
        reqs = {t.req_id for t in meta.loads}
        rounds = self._rounds(meta)
        loads: list[tuple[kvmove.Transfer, list[int]]] = []
        try:
            if self.mover is None:
                raise kvmove.KVMoveError("no KV cache registered")
            for keys, ids in rounds:
                loads.append((self.mover.prefetch(keys, block_pages(ids)), ids))
        except Exception as e:
            blocks = [b for _, ids in rounds[len(loads):] for b in ids]
            log.warning("kvmove connector: %d blocks not loaded (%s); vLLM recomputes them",
                        len(blocks), e)
            self._load_errors.update(blocks)
        self._recving.append((loads, reqs))

    def finished_loads(self) -> set[str]:
        """The requests whose asynchronous loads have ended since the last call: their
        blocks are in vLLM's KV cache (on CUDA, the engine's current stream waits for the
        scatter), or failed, reported by :meth:`take_load_errors` from now on."""
        finished: set[str] = set()
        left = []
        for loads, reqs in self._recving:
            if all(t.done() and t.scattered.query() for t, _ in loads):
                for transfer, ids in loads:
                    self._finish_load(transfer, ids)
                finished |= reqs
            else:
                left.append((loads, reqs))
        self._recving = left
        return finished

    def wait_for_layer(self, layer_name: str) -> None:
        if not self._loads:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for transfer, _ in self._loads:
            transfer.wait_layer(layer)

    def _finish_load(self, transfer: kvmove.Transfer, block_ids: list[int]) -> None:
        try:
            statuses = transfer.wait()
        except Exception as e:  # never the step: the blocks are recomputed
            log.warning("kvmove connector: a load of %d blocks failed: %r", len(block_ids), e)
            self._load_errors.update(block_ids)
            return
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
        transfer = None
        try:
            self._finish_loads()
            self._reap_saves()
            transfer = self._save(meta)
        finally:
            if meta.save_job is not None:  # reported once its transfer (if any) is done
                self._save_jobs.append((meta.save_job, transfer))

    def _save(self, meta: KVMoveConnectorMetadata) -> kvmove.Transfer | None:
        """This rank's share of the step's saves, as one evict (None: nothing started)."""
        if not meta.saves or self.mover is None:
            return None
        # Ranks with byte-identical blocks share one namespace: this rank saves its share
        # of them (plan.saves_block), the others the rest. An evict's keys are unique.
        # Blocks with the same key hold the same bytes (two requests with the same prefix,
        # vLLM's prefix cache off): save the first of them.
        first_block: dict[str, int] = {}
        for t in meta.saves:
            for h, b, pos in zip(t.keys, t.block_ids, t.positions(), strict=True):
                if self.plan.saves_block(self.tp_rank, pos):
                    first_block.setdefault(self.key_prefix + h, b)
        if not first_block:
            return None
        # Saves start at a request's first block (see SchedulerSide). The mover's put asks
        # the master which keys it holds and sends only the others (they end EXISTS), as
        # vLLM's connector does (on a GPU, in the background): no query of its own on the
        # engine's thread first. Blocks the scheduler's lookup found in no namespace go
        # without that query (one master request less; Mooncake keeps an object stored
        # since, and answers OK; a put that timed out removes it, see KVMover.evict).
        keys, block_ids = list(first_block), list(first_block.values())
        pages = block_pages(block_ids)
        absent = all(t.absent_at_lookup for t in meta.saves)
        # In staging-sized pieces where needed, never waiting for staging slots that puts
        # in flight or asynchronous loads hold: a save missed costs a recompute, never the
        # step.
        try:
            transfer = self.mover.evict(keys, pages, detect_exists=False if absent else None,
                                        wait_for_staging=False)
        except kvmove.StagingFull as e:
            log.warning("kvmove connector: %d block saves skipped: %s", len(keys), e)
            return None
        # vLLM reuses the blocks once the scheduler released them (after this job was reported
        # done); where it does not hold them, only after this: the gather (CUDA, staged) or
        # the put that reads them in place
        if meta.save_job is None:
            transfer.gathered.wait()
        self._saves.append(transfer)
        return transfer

    def done_saves(self) -> KVMoveWorkerMetadata | None:
        """The save jobs whose transfer has ended since the last call (for vLLM's scheduler
        side, which then releases their blocks), or None."""
        done, left = {}, []
        for job, transfer in self._save_jobs:
            if transfer is None or transfer.done():
                done[job] = 1
            else:
                left.append((job, transfer))
        self._save_jobs = left
        return KVMoveWorkerMetadata(done) if done else None

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
            # Asynchronous loads too: the rows must not be written after this.
            self._loads += [load for loads, _ in self._recving for load in loads]
            self._recving = []
            self._finish_loads()
            self._reap_saves(wait=True)
            self.mover.close()
            self.mover = None
        self.store.close()
