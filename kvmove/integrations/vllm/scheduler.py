"""The vLLM connector's scheduler side: looks up a request's blocks in the store (one
batched ``exists``) and schedules loads and saves into each step's metadata."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import kvmove
from kvmove.integrations.vllm.metadata import KVMoveConnectorMetadata, KVMoveWorkerMetadata
from kvmove.integrations.vllm.plan import BlockTransfer, ConnectorPlan
from kvmove.integrations.vllm.store_config import connector_store_config

if TYPE_CHECKING:
    from kvmove.store.protocol import Store

log = logging.getLogger(__name__)


@dataclass
class _Request:
    request: Any
    block_ids: list[int]
    saved_blocks: int  # blocks [0, saved_blocks) are scheduled for saving already
    load: BlockTransfer | None = None
    # blocks [absent[0], absent[1]) were in no namespace when the request was looked up
    absent: tuple[int, int] | None = None


class SchedulerSide:
    """The connector's scheduler side: one batched ``exists`` per request, loads and saves
    scheduled in the step's metadata. Saves follow vLLM's ``MooncakeStoreConnector``: a
    request's full blocks from its first block on (the worker puts only the keys the store
    lacks), none in a step that loads the request's blocks. Blocks the lookup found nowhere
    are marked ``absent_at_lookup`` and put without an ``exists`` first. A step's saves are
    one job that holds a reference on each of its blocks (once :meth:`bind_pool` ran) until
    all ``workers`` reported it done (:meth:`saves_done`): vLLM cannot reuse a block a put
    still reads."""
    # Were a load to fail, tokens computed in its step over those blocks would be stored
    # under good keys: that step saves nothing, its next one does. An absent_at_lookup put
    # of a key stored meanwhile (another request, same prefix) ends OK and the object stays,
    # unless that put timed out: then the key is removed once the call returns (a later miss,
    # see KVMover.evict).

    def __init__(self, plan: ConnectorPlan, workers: int = 1, hold_blocks: bool = True):
        self.plan = plan
        # The scheduler only asks what exists: it contributes no memory to the store.
        self.store: Store = kvmove.MooncakeStore(connector_store_config().replace(
            global_segment_size=0))
        self._pending: dict[str, tuple[int, int]] = {}  # req -> (computed, hit) tokens
        self._absent: dict[str, tuple[int, int]] = {}  # req -> blocks its lookup did not find
        self._reqs: dict[str, _Request] = {}
        self._to_load: list[str] = []  # reqs allocated for an asynchronous load, not sent
        self._loading: dict[str, BlockTransfer] = {}  # req -> its asynchronous load in flight
        self._failed_from: dict[str, int] = {}  # req -> first block whose async load failed
        self.workers = workers
        self.hold_blocks = hold_blocks  # False: saves wait for their puts instead
        self._pool = None  # vLLM's block pool, once bound
        self._next_job = 0
        self._held: dict[int, tuple[list, int]] = {}  # job -> (blocks held, workers to report)

    # -- holding the blocks of saves in flight ----------------------------------------------
    def bind_pool(self, pool) -> None:
        """vLLM's (GPU) block pool: saves hold their blocks there from now on (unless
        ``hold_blocks`` is off)."""
        if self.hold_blocks:
            self._pool = pool

    def _hold_saves(self, meta: KVMoveConnectorMetadata) -> None:
        if not meta.saves or self._pool is None:
            return
        pool = self._pool
        ids = dict.fromkeys(b for t in meta.saves for b in t.block_ids)  # each once
        blocks = [pool.blocks[b] for b in ids]
        pool.touch(blocks)
        meta.save_job = job = self._next_job
        self._next_job += 1
        self._held[job] = (blocks, self.workers)

    def saves_done(self, worker_meta) -> None:
        """Release the blocks of every save job all workers have reported done."""
        if not isinstance(worker_meta, KVMoveWorkerMetadata):
            return
        for job, workers in worker_meta.done_saves.items():
            held = self._held.get(job)
            if held is None:
                log.warning("kvmove connector: save job %d reported done, but not held", job)
                continue
            blocks, left = held
            left -= workers
            if left > 0:
                self._held[job] = (blocks, left)
                continue
            del self._held[job]
            self._pool.free_blocks(reversed(blocks))  # the last block evicted first

    def holds_blocks(self) -> bool:
        """Whether a save job still holds blocks (vLLM keeps stepping until none does, so
        that the workers' reports reach this side)."""
        return bool(self._held)

    def loads_done(self, finished: set[str] | None, invalid: set[int] | None) -> None:
        """Note where each asynchronous load failed (vLLM's ``invalid_block_ids``) and which
        loads ended (``finished_recving``). A request whose load failed at its first block
        goes back to vLLM's queue with nothing computed and is looked up again: its hit
        stops before the failed block until vLLM admits it (a lookup may come to nothing:
        no free blocks, prefills deferred), or it would load the same failing object
        (wrong-sized, unreadable) again, and again."""
        if invalid:
            for req_id, load in self._loading.items():
                bad = [i for i, b in enumerate(load.block_ids) if b in invalid]
                if bad:
                    at = load.first_block + bad[0]
                    self._failed_from[req_id] = min(at, self._failed_from.get(req_id, at))
        for req_id in finished or ():
            self._loading.pop(req_id, None)

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        plan = self.plan
        self._absent.pop(request.request_id, None)  # an earlier lookup's answer is stale now
        failed_from = self._failed_from.get(request.request_id)
        if not plan.can_load:
            return 0
        bs = plan.block_size
        hashes = plan.hashes(request)[: request.num_tokens // bs]
        first = num_computed_tokens // bs
        if len(hashes) <= first:
            return 0
        namespaces = plan.lookup_namespaces()
        part = plan.keys.tenant_part(request)  # "" without a tenant: vLLM's own keys
        keys = [k for ns in namespaces for k in plan.keys.keys(ns, hashes, part)]
        try:
            found = list(self.store.exists(keys))
        except Exception as e:  # an unreachable master: no hit, never a failed request
            log.warning("lookup of %d blocks failed: %s", len(hashes), e)
            return 0
        n = len(hashes)
        grid = np.asarray(found, dtype=bool).reshape(len(namespaces), n)  # [namespace, block]
        everywhere = grid.all(axis=0)
        hit = n if everywhere.all() else int(np.argmin(everywhere))  # the first block missing
        # Blocks past the last one any namespace holds are absent (their saves need no
        # exists query); the request's state takes this over in after_alloc.
        held = np.flatnonzero(grid.any(axis=0))
        self._absent[request.request_id] = (int(held[-1]) + 1 if held.size else 0, n)
        if plan.eagle_block_drop and hit:  # as vLLM's lookups: the last block is dropped
            hit -= 1
        if failed_from is not None:  # its last load failed there: not again
            hit = min(hit, failed_from)
        hit_tokens = hit * bs
        if hit_tokens >= request.num_tokens:  # vLLM computes at least the last token
            hit_tokens = (request.num_tokens - 1) // bs * bs
        if hit_tokens <= num_computed_tokens:
            return 0
        self._pending[request.request_id] = (num_computed_tokens, hit_tokens)
        return hit_tokens - num_computed_tokens

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        computed, hit = self._pending.pop(request.request_id, (0, 0))
        self._failed_from.pop(request.request_id, None)  # admitted with the shorter hit
        # Scheduled once its asynchronous load ended, a request is allocated again with no
        # lookup in between: its lookup's answer still holds.
        earlier = self._reqs.get(request.request_id)
        absent = self._absent.pop(request.request_id,
                                  earlier.absent if earlier is not None else None)
        state = _Request(request, list(block_ids), saved_blocks=0, absent=absent)
        if num_external_tokens > 0:
            bs = self.plan.block_size
            first, end = computed // bs, hit // bs
            # Tenant part and hash hex: each worker puts its own rank namespace in front.
            hashes = self.plan.hashes(request)[first:end]
            part = self.plan.keys.tenant_part(request)
            state.load = BlockTransfer(request.request_id,
                                       [part + h.hex() for h in hashes],
                                       state.block_ids[first:end], first)
            if self.plan.load_async:
                self._to_load.append(request.request_id)
        self._reqs[request.request_id] = state

    def build_meta(self, out) -> KVMoveConnectorMetadata:
        meta = KVMoveConnectorMetadata()
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            state.saved_blocks = 0
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
                continue  # no save in a step that loads
            self._add_save(meta, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Back after preemption (vLLM's V1 model runner): its blocks were freed, it
                # has all-new ones, and its store hit (looked up again, counted in
                # num_computed_tokens) loads into them now, as a new request's does.
                state.block_ids = list(new_ids[0]) if new_ids else []
                state.saved_blocks = 0
                if state.load is not None:
                    meta.loads.append(state.load)
                    state.load = None
                    continue  # no save in a step that loads
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            self._add_save(meta, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        # A request whose load is asynchronous is not scheduled in the step that loads it:
        # it waits for its blocks (WAITING_FOR_REMOTE_KVS) while the workers get them in
        # the background, and is scheduled once they all reported it finished.
        for req_id in self._to_load:
            state = self._reqs.get(req_id)
            if state is not None and state.load is not None:
                meta.loads.append(state.load)
                self._loading[req_id] = state.load
                state.load = None
        self._to_load.clear()
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        self._hold_saves(meta)
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
        absent = state.absent is not None and state.absent[0] <= first and full <= state.absent[1]
        part = self.plan.keys.tenant_part(state.request)
        meta.saves.append(BlockTransfer(state.request.request_id,
                                        [part + h.hex() for h in hashes[first:full]],
                                        state.block_ids[first:full], first,
                                        absent_at_lookup=absent))

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._absent.pop(req_id, None)
        self._loading.pop(req_id, None)
        self._failed_from.pop(req_id, None)

    # The worker-side methods are not called on this side.
    def close(self) -> None:
        self.store.close()
