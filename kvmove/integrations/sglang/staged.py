"""The staged path of SGLang's MLA ``layer_first`` host pools: a :class:`kvmove.KVMover`
whose cache row is one SGLang page of one layer and whose staging is ``page_first``, so a
staging slot holds SGLang's object contiguously, byte for byte, under SGLang's own keys.
Each direction's path is chosen as a mover's ``path`` is (:mod:`kvmove.mover.path_choice`):
``extra_config`` ``kvmove_path`` / ``KVMOVE_SGLANG_PATH``; the staging's size
``kvmove_staging_bytes`` / ``KVMOVE_SGLANG_STAGING_BYTES`` (default 256 MiB). A staged put
reads the pool's rows before it returns, and a staged get writes only pages read whole: a
store call that timed out never touches the pool afterwards. See ``docs/API.md``, "SGLang".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

import kvmove
from kvmove.errors import StagingFull
from kvmove.mover.path_choice import PATHS, PathChoice, check_path, probe, resolve
from kvmove.store.config import parse_size

if TYPE_CHECKING:
    from kvmove.store.protocol import Store

log = logging.getLogger(__name__)

PATH_KEY, PATH_VAR = "kvmove_path", "KVMOVE_SGLANG_PATH"
STAGING_KEY, STAGING_VAR = "kvmove_staging_bytes", "KVMOVE_SGLANG_STAGING_BYTES"
DEFAULT_STAGING_BYTES = 256 << 20
# The auto probe's scratch pages: as many as fit this many bytes (4 to 32 pages).
PROBE_BYTES = 64 << 20
# Of the mover's staging: one-row pages, every layer side by side. In place, a page of few
# tokens is one small span per layer and Mooncake's cost is per span: 512 one-token pages of
# 61 layers move at 0.10 GB/s over loopback TCP, the same bytes as one span per page at
# about 2 GB/s (bench/bench_sglang.py).
LAYOUT = "page_first"
# Under auto a direction goes staged only where the probe found it this much faster: in
# place is what SGLang's own backend does and needs no staging memory, and a near tie flips
# with the machine's noise (measured: a probe that found staged gets 3 % faster at 16-token
# pages, then 0.89x in place's speed over 32 pages of 1.1 MiB).
STAGED_MIN_GAIN = 0.2


def settings(extra_config: Mapping | None, environ: Mapping[str, str] | None = None
             ) -> tuple[str, int]:
    """``(path, staging bytes)`` from SGLang's ``extra_config`` (first) or the environment;
    a bad value raises ``ValueError`` naming where it came from."""
    env = os.environ if environ is None else environ
    extra = extra_config or {}

    def read(key: str, var: str):
        if extra.get(key) is not None:
            return extra[key], f"extra_config {key!r}"
        value = env.get(var, "").strip()
        return (value or None), f"environment variable {var}"

    path, where = read(PATH_KEY, PATH_VAR)
    if path is None:
        path = "auto"
    elif path not in PATHS:
        raise ValueError(f"{where} must be one of {PATHS}, got {path!r}")
    size, where = read(STAGING_KEY, STAGING_VAR)
    if size is None:
        return path, DEFAULT_STAGING_BYTES
    nbytes = parse_size(size, where)  # raises naming where
    if nbytes <= 0:
        raise ValueError(f"{where} must be a positive size, got {size!r}")
    return path, nbytes


def page_rows(kv_buffer: torch.Tensor, page_size: int) -> kvmove.KVCache:
    """The cache whose row ``p`` of layer ``l`` is SGLang's page ``p`` of layer ``l`` of a
    ``layer_first`` MLA ``kv_buffer`` (``[L, size, 1, dim]``): ``page_size`` token rows,
    one span (views, no copy). A trailing part page (``size % page_size`` tokens) is left
    out: SGLang never hands one out."""
    if kv_buffer.dim() != 4 or not kv_buffer.is_contiguous():
        raise ValueError(f"a layer_first MLA kv_buffer is a contiguous [L, size, 1, dim] "
                         f"tensor, got shape {tuple(kv_buffer.shape)}")
    layers, size = kv_buffer.shape[:2]
    pages = size // page_size
    page_bytes = page_size * kv_buffer[0, 0].numel() * kv_buffer.element_size()
    flat = kv_buffer.view(torch.uint8).view(layers, -1)
    return kvmove.KVCache({"kv": [flat[i, : pages * page_bytes].view(pages, page_bytes)
                                  for i in range(layers)]})


class StagedPages:
    """Puts and gets of a ``layer_first`` MLA pool's pages through staging, for the
    directions where the path choice (:attr:`choice`) is ``"staged"``; the caller moves the
    others in place."""

    def __init__(self, kv_buffer: torch.Tensor, page_size: int, store: Store, *,
                 path: str = "auto",
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        check_path(path)
        self.cache = page_rows(kv_buffer, page_size)
        self.object_bytes = self.cache.row_bytes("kv") * self.cache.num_layers("kv")
        self.store: Store = store
        self.choice: PathChoice
        # (a probe that fails leaves the pages in place, as SGLang's own backend moves them)
        choice = resolve(path, self.cache, store, page_tokens=1, layout=LAYOUT, checksum=False,
                         probe=self._probe, probe_failed="in_place")
        choice = self.choice = prefer_in_place(choice)
        self.mover: kvmove.KVMover | None = None
        if "staged" in (choice.evict, choice.prefetch):
            slots = max(1, min(staging_bytes // self.object_bytes, self.cache.num_slots))
            self.mover = kvmove.KVMover(self.cache, store, page_tokens=1, staging_slots=slots,
                                        raw_keys=True, layout=LAYOUT, path="staged")
        log.info("kvmove SGLang backend, layer_first MLA pool (%d-byte objects): puts %s, "
                 "gets %s (%s)", self.object_bytes, choice.evict, choice.prefetch,
                 choice.reason)

    def _probe(self) -> dict:
        def scratch_mover(cache, path, slots):
            return kvmove.KVMover(cache, self.store, page_tokens=1, staging_slots=slots,
                                  layout=LAYOUT, workers=1, path=path)

        return probe(self.cache, self.store, page_tokens=1, layout=LAYOUT,
                     make_mover=scratch_mover, pages=PROBE_BYTES // self.object_bytes)

    def staged(self, *, put: bool) -> bool:
        """Whether puts (``put=True``) or gets go through staging."""
        return self.mover is not None and (
            self.choice.evict if put else self.choice.prefetch) == "staged"

    @staticmethod
    def takes(keys: list[str], pages) -> bool:
        """Whether a call of these object keys and page numbers can go through staging:
        neither a key nor a page repeats (a mover refuses those; in place they move as
        SGLang's own backend moves them)."""
        return len(set(keys)) == len(keys) and len(set(_as_list(pages))) == len(keys)

    def move(self, keys: list[str], pages, *, put: bool) -> list[kvmove.Status]:
        """Store page ``pages[i]`` under object key ``keys[i]`` (``put=True``), or read the
        object into it; one status per key. A get leaves the rows of a key that is not
        ``OK`` untouched. Staging that stays full for the mover's ``alloc_timeout`` (slots
        held by store calls that timed out) fails the call's keys, as a failed store call
        would."""
        page_array = _page_array(pages)
        if not put:
            transfer = self.mover.prefetch(keys, page_array)
            statuses = transfer.wait()
            transfer.scattered.synchronize()
            return statuses
        try:
            return self.mover.evict(keys, page_array).wait()
        except StagingFull as e:
            log.warning("kvmove SGLang backend: %s; %d pages not stored", e, len(keys))
            return [kvmove.Status.FAILED] * len(keys)

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()


def prefer_in_place(choice: PathChoice) -> PathChoice:
    """``choice`` with each direction that a probe put staged moved in place unless staged
    was at least :data:`STAGED_MIN_GAIN` faster there (a choice without figures, or one
    the probe found unsafe, as it is)."""
    figures = choice.figures
    if "staged" not in figures or "in_place" not in figures:
        return choice
    picked = {}
    for direction in ("evict", "prefetch"):
        path = getattr(choice, direction)
        if path == "staged" and (figures["staged"][direction]
                                 > (1 - STAGED_MIN_GAIN) * figures["in_place"][direction]):
            path = "in_place"
        picked[direction] = path
    if (picked["evict"], picked["prefetch"]) == (choice.evict, choice.prefetch):
        return choice
    return PathChoice(picked["evict"], picked["prefetch"],
                      f"{choice.reason}; staged only where {STAGED_MIN_GAIN:.0%} faster: puts "
                      f"{picked['evict']}, gets {picked['prefetch']}", figures, choice.recorded)


def _as_list(pages) -> list[int]:
    return pages if isinstance(pages, list) else pages.tolist()


def _page_array(pages) -> np.ndarray:
    """Page numbers (an int64 array or a list) as the ``[n, 1]`` pages of the mover (a numpy
    array: the mover takes it as it is, with no tensor made on the way)."""
    return np.asarray(pages, dtype=np.int64).reshape(-1, 1)
