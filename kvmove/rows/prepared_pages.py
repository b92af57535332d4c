"""Prepared page indices: the pages and slots of a gather or scatter that an engine runs
again and again (its index buffers are reused), checked and planned once. The values are
snapshotted when prepared: the caller's tensors may change afterwards without changing what
moves. Explicit, never a hidden cache keyed on data that may change.
"""

from __future__ import annotations

import torch

from kvmove.memory.cache import KVCache
from kvmove.memory.staging import StagingBuffer
from kvmove.rows.moves import (
    PagePlan,
    check_pools,
    error_counter,
    page_indices,
    plan_pages,
    run_pages,
)
from kvmove.rows.prepared import PreparedCopy, prepared_copy


class PreparedPages:
    """``token_pages`` ``[n, page_tokens]`` and ``slots`` ``[n]`` of one KV cache and
    staging, snapshotted and checked once (:func:`prepare_pages`). :meth:`gather` and
    :meth:`scatter` move them as :func:`kvmove.gather` / :func:`kvmove.scatter` would,
    planning once per direction and layer set, then only copying."""

    __slots__ = ("_checked", "_plans", "backend", "check", "kv", "slots", "staging",
                 "token_pages")

    def __init__(self, kv: KVCache, staging: StagingBuffer, token_pages: torch.Tensor,
                 slots: torch.Tensor, *, backend: str, check: bool):
        self.kv, self.staging, self.backend, self.check = kv, staging, backend, check
        self.token_pages, self.slots = token_pages, slots
        self._plans: dict = {}  # id(prepared copy) -> (prepared copy, its PagePlan)
        self._checked: set[str] = set()  # directions whose checks have run

    def __len__(self) -> int:
        return self.token_pages.shape[0]

    def _plan(self, prepared: PreparedCopy) -> PagePlan:
        found = self._plans.get(id(prepared))
        if found is not None and found[0] is prepared:
            return found[1]
        check = self.check and prepared.direction not in self._checked
        plan = plan_pages(prepared, self.token_pages, self.slots, check=check)
        if check:
            self._checked.add(prepared.direction)
        self._plans[id(prepared)] = (prepared, plan)
        return plan

    def gather(self, *, errors: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`kvmove.gather` of these pages: every layer of every buffer. Returns the
        error counter."""
        prepared = prepared_copy(self.kv.row_pool, self.staging.row_pool,
                                 backend=self.backend, direction="gather",
                                 page_tokens=self.staging.page_tokens)
        errors = error_counter(errors, prepared.device)
        run_pages(prepared, self._plan(prepared), errors)
        return errors

    def scatter(self, *, layers=None, errors: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`kvmove.scatter` of these pages: every layer (``layers=None``), layer ``l``
        of every buffer that has it, or a subset. Returns the error counter."""
        prepared = prepared_copy(self.staging.row_pool, self.kv.row_pool, layers,
                                 backend=self.backend, direction="scatter",
                                 page_tokens=self.staging.page_tokens)
        errors = error_counter(errors, prepared.device)
        run_pages(prepared, self._plan(prepared), errors)
        return errors


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private int64 copy of an index tensor (on its device, in stream order)."""
    return t.to(torch.int64, copy=True).contiguous()


def prepare_pages(kv: KVCache, staging: StagingBuffer, token_pages, slots, *,
                  backend: str = "auto", check: bool = True) -> PreparedPages:
    """The :class:`PreparedPages` of ``token_pages`` and ``slots`` (as for
    :func:`kvmove.gather`): their values copied now, their shapes, dtypes and devices
    checked. With ``check=True`` the checks of ``check=True`` run too, once per direction
    (on its first gather or scatter), before anything is written."""
    check_pools(kv, staging)
    prepared = prepared_copy(kv.row_pool, staging.row_pool, backend=backend,
                             direction="gather", page_tokens=staging.page_tokens)
    token_pages, slots = page_indices(prepared, token_pages, slots)
    return PreparedPages(kv, staging, _snapshot(token_pages), _snapshot(slots),
                         backend=backend, check=check)
