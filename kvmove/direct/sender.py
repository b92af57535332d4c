"""``PageSender``: a prefill process writes pages of its KV cache straight into a decode
process's host pool (a :class:`~kvmove.PageReceiver`), one network hop."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from kvmove.checks import (
    as_index_tensor,
    as_int_array,
    check_positive_int,
    check_range,
    check_seconds,
)
from kvmove.direct.handle import BufferPlace, PageHandle
from kvmove.direct.job import SendJob
from kvmove.direct.link import PeerLink
from kvmove.direct.slots import LayerSlots, SlotsClosed
from kvmove.direct.spans import plan_spans
from kvmove.errors import KVMoveError, StagingFull
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import StagingBuffer
from kvmove.metrics import record as metrics
from kvmove.mover.transfer import Transfer, TransferResult
from kvmove.rows.moves import copy_pages
from kvmove.rows.prepared import prepared_copy, resolve_backend
from kvmove.status import CLIENT_EXCEPTION, NOT_SENT, STAGING_TIMEOUT, Status
from kvmove.store.bounded_call import Watchdog
from kvmove.store.transfer_engine import ENGINE_ENV_DEFAULTS, TransportSettings
from kvmove.tuning.autotune import tune_for_copies

log = logging.getLogger(__name__)

HANDLES_KEPT = 256  # parsed handles kept (least recently used dropped)
RETRY_AFTER_S = 1.0  # a receiver whose link broke is tried again after this long, ...
RETRY_AFTER_MAX_S = 30.0  # ... doubling while its links keep breaking, up to this
MOONCAKE_MIN_TIMEOUT_S = 5  # Mooncake raises an MC_TRANSFER_TIMEOUT below this to it
CALL_TIMEOUT_MARGIN_S = 1.0  # call_timeout exceeds Mooncake's write timeout by this much


def mooncake_write_timeout(environ=None) -> int:
    """Seconds after which a write times out in Mooncake (0.3.13) itself, in the engines
    this process makes now: ``MC_TRANSFER_TIMEOUT`` as Mooncake reads it (C ``atoi``,
    raised to 5), or kvmove's default (5) where it is not set. Mooncake adds 1 ns per byte
    of the call (under 0.1 s for the largest call a sender makes)."""
    env = os.environ if environ is None else environ
    raw = env.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        raw = ENGINE_ENV_DEFAULTS["MC_TRANSFER_TIMEOUT"]
    number = re.match(r"\s*([+-]?\d+)", raw)
    return max(MOONCAKE_MIN_TIMEOUT_S, int(number.group(1)) if number else 0)


class _Staged:
    """The staging of one layout, its slots, the prepared gathers into it (every layer,
    and each layer alone) and where its bytes are."""

    def __init__(self, kv: KVCache, layout: str, num_slots: int, page_tokens: int,
                 backend: str):
        self.staging = StagingBuffer(kv, num_slots=num_slots, page_tokens=page_tokens,
                                     layout=layout)
        self.slots = LayerSlots(kv.max_layers, num_slots)
        pools = kv.row_pool, self.staging.row_pool
        common = {"backend": backend, "direction": "gather", "page_tokens": page_tokens}
        self.gather_all = prepared_copy(*pools, **common)
        self.gather_layer = [prepared_copy(*pools, layer, **common)
                             for layer in range(kv.max_layers)]
        self.places = [
            BufferPlace.of_view(name, self.staging.tensor(name), layout=layout,
                                layers=kv.num_layers(name), row_bytes=kv.row_bytes(name),
                                page_tokens=page_tokens, num_pages=num_slots)
            for name in kv.buffer_names]
        self.regions = self.staging.regions()

    def gather_of(self, layer: int | None):
        return self.gather_all if layer is None else self.gather_layer[layer]


class PageSender:
    """Writes pages of ``kv`` (a :class:`kvmove.KVCache`, on a GPU or the host) into the
    host pools of :class:`kvmove.PageReceiver` processes, named by their handles: gathered
    into ``staging_slots`` pages of staging, written in the background through one Transfer
    Engine per receiver. ``call_timeout`` must exceed Mooncake's own write timeout
    (:func:`mooncake_write_timeout`) by :data:`CALL_TIMEOUT_MARGIN_S` (``ValueError``
    otherwise). Thread-safe; ``close()`` (or a ``with`` block) waits for the sends and
    transfers in flight. The contract is ``docs/API.md``, "Prefill -> decode host memory
    (direct transfer)".
    """

    def __init__(self, kv: KVCache, *, page_tokens: int = 64, staging_slots: int = 256,
                 backend: str = "auto", alloc_timeout: float | None = 60.0,
                 call_timeout: float = 8.0, hostname: str | None = None):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        self.page_tokens = check_positive_int(page_tokens, "page_tokens")
        self.staging_slots = check_positive_int(staging_slots, "staging_slots")
        call_timeout = check_seconds(call_timeout, "call_timeout")
        alloc_timeout = check_seconds(alloc_timeout, "alloc_timeout", none_ok=True,
                                      zero_ok=True)
        mooncake = mooncake_write_timeout()
        if call_timeout < mooncake + CALL_TIMEOUT_MARGIN_S:
            said = os.environ.get("MC_TRANSFER_TIMEOUT")
            source = ("kvmove's default, MC_TRANSFER_TIMEOUT unset" if said is None else
                      f"MC_TRANSFER_TIMEOUT={said!r}; Mooncake raises values below "
                      f"{MOONCAKE_MIN_TIMEOUT_S} to {MOONCAKE_MIN_TIMEOUT_S}")
            raise ValueError(
                f"call_timeout ({call_timeout:g} s) must be at least {CALL_TIMEOUT_MARGIN_S:g} "
                f"s above Mooncake's own write timeout ({mooncake} s: {source}), so that a "
                f"write to a receiver that stopped answering fails in Mooncake first; raise "
                f"call_timeout or lower MC_TRANSFER_TIMEOUT")
        self.settings = TransportSettings.from_env(local_hostname=hostname)
        self.kv = kv
        self.device = kv.device  # the gathers run there (the staging is host memory)
        resolve_backend(backend, self.device)  # validates; "auto" is resolved per buffer
        self.backend = backend
        self.alloc_timeout = alloc_timeout
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _sending drops to 0
        self._sending = 0  # send() calls in progress
        self._closed = False
        self._staged: dict[str, _Staged] = {}
        self._links: dict[str, PeerLink] = {}  # peer -> its link (the last one, maybe broken)
        self._targets: OrderedDict[str, tuple[PageHandle, list[BufferPlace]]] = OrderedDict()
        self._watchdog = Watchdog(call_timeout)
        self._geometry = {n: (kv.num_layers(n), kv.row_bytes(n)) for n in kv.buffer_names}
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        tune_for_copies(self.device, [kv.row_bytes(n) for n in kv.buffer_names], page_tokens)
        self._staging_for("layer_first")  # the common one: made and warmed up now

    # -- public ---------------------------------------------------------------------------
    def send(self, handle, token_pages, dst_pages, *, layers: int | None = None) -> Transfer:
        """Write the token slots ``token_pages[i]`` (int ``[n, page_tokens]``, ``-1`` only
        as a page's suffix) into page ``dst_pages[i]`` of the receiver ``handle`` names:
        every layer (``layers=None``) or layer ``layers`` of every buffer that has it.
        Returns a :class:`kvmove.Transfer` once the pages are gathered; its ``wait()`` gives
        ``OK`` or ``FAILED`` per page. Raises ``ValueError`` / ``IndexError`` /
        ``TypeError`` for bad arguments, :class:`kvmove.StagingFull` and
        :class:`kvmove.KVMoveError`, before any byte moves; see ``docs/API.md``,
        "Prefill -> decode host memory (direct transfer)"."""
        with self._lock:
            if self._closed:
                raise KVMoveError("the PageSender is closed")
            self._sending += 1
        started = metrics.clock()
        try:
            transfer = self._send(handle, token_pages, dst_pages, layers)
            metrics.call_done("send", started)
            return transfer
        finally:
            with self._lock:
                self._sending -= 1
                if not self._sending:
                    self._idle.notify_all()

    def _send(self, handle, token_pages, dst_pages, layers: int | None) -> Transfer:
        target, places = self._target(handle)
        layer = _check_layer(layers, self.kv.max_layers)
        pages, valid = self._check_pages(token_pages)
        n = pages.shape[0]
        dst = _check_page_numbers(dst_pages, n, target.num_pages, "dst_pages")
        staged = self._staging_for("page_first" if target.layout == "page_first"
                                   else "layer_first")
        transfer = Transfer([str(d) for d in dst.tolist()], kind="send",
                            num_layers=self.kv.max_layers, device=self.device)
        ordered = None
        if self._stream is not None:
            ordered = torch.cuda.Event()
            ordered.record(torch.cuda.current_stream(self.device))
        size = self.staging_slots
        for first in range(0, n, size):
            last = min(n, first + size)
            try:
                slots = staged.slots.alloc(last - first, layer, timeout=self.alloc_timeout)
            except SlotsClosed:
                if first == 0:
                    raise KVMoveError("the PageSender is closed") from None
                _not_sent(transfer, first, n, NOT_SENT, "the sender was closed")
                break
            except StagingFull:
                if first == 0:
                    raise
                _not_sent(transfer, first, n, STAGING_TIMEOUT,
                          f"no staging slots came free within {self.alloc_timeout} s")
                break
            job = None
            try:
                job = self._stage(staged, places, pages[first:last], dst[first:last],
                                  valid[first:last], slots, layer, ordered)
                closed = not self._submit(target.peer, job)
                failure = KVMoveError("the PageSender is closed") if closed else None
            except KVMoveError as e:  # no engine could be made
                closed, failure = False, e
            except BaseException:
                self._unstage(staged, job, slots, layer)
                raise
            if failure is not None:
                self._unstage(staged, job, slots, layer)
                if first == 0:
                    raise failure
                _not_sent(transfer, first, n, NOT_SENT if closed else CLIENT_EXCEPTION,
                          str(failure))
                break
            transfer.add_piece(first, job.future)
            if job.gathered is not None:
                transfer.gathered = job.gathered
        return transfer

    def close(self) -> None:
        """Wait for the sends in progress (a later piece of one, not started yet, ends
        ``FAILED``, ``NOT_SENT``) and the transfers in flight (each write ends within
        ``call_timeout``), destroy the engines, free the staging. Idempotent. A call the
        transport never returned in time is left to its thread, which destroys its engine
        when it returns (if that call was a write of the staging, the staging is freed only
        then, when its slots come back)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no send starts, no piece is handed on, no staging made
            staged = list(self._staged.values())
        for s in staged:
            s.slots.close()  # a send waiting for slots stops waiting
        with self._lock:
            self._idle.wait_for(lambda: not self._sending)
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        for link in links:
            link.wait_finished()
        self._watchdog.stop()
        for s in staged:
            if not s.slots.when_all_free(s.staging.close):
                log.warning("a write that never returned still reads the staging; it is "
                            "freed when that write ends")

    def __enter__(self) -> PageSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._links)} receiver(s)"
        return (f"PageSender({self.staging_slots} slots x {self.page_tokens} tokens, "
                f"{self.settings.protocol}, {state})")

    # -- checks ---------------------------------------------------------------------------
    def _target(self, handle) -> tuple[PageHandle, list[BufferPlace]]:
        """The receiver ``handle`` names, checked against this cache's geometry, and its
        buffers' places in this cache's buffer order (parsed once per handle)."""
        key = handle.encode() if isinstance(handle, PageHandle) else handle
        with self._lock:
            hit = self._targets.get(key) if isinstance(key, str) else None
            if hit is not None:
                self._targets.move_to_end(key)
                return hit
        target = PageHandle.parse(handle)
        if target.geometry != self._geometry or target.page_tokens != self.page_tokens:
            raise ValueError(
                f"the receiver's pool differs from this sender's cache (buffer: (layers, row "
                f"bytes)): receiver {target.geometry} in {target.page_tokens}-token pages, "
                f"sender {self._geometry} in {self.page_tokens}-token pages")
        by_name = {b.name: b for b in target.buffers}
        hit = target, [by_name[name] for name in self.kv.buffer_names]
        with self._lock:
            self._targets[key] = hit
            while len(self._targets) > HANDLES_KEPT:
                self._targets.popitem(last=False)
        return hit

    def _check_pages(self, token_pages) -> tuple[torch.Tensor, np.ndarray]:
        """The token slots as an int64 CPU tensor (a copy: the caller may reuse its own;
        device indices are read on the host, which waits for the device) and each page's
        valid tokens."""
        pages = as_index_tensor(token_pages, "token_pages", dim=2, device=self.device)
        n, p = pages.shape
        if n and p != self.page_tokens:
            raise ValueError(f"token_pages has {p} tokens per page, the sender's page_tokens "
                             f"is {self.page_tokens}")
        host = pages.cpu().numpy().astype(np.int64, copy=True)
        check_range(torch.from_numpy(host), self.kv.num_slots, "token_pages")
        return torch.from_numpy(host), _padded_page_lengths(host, "token_pages")

    # -- steps ----------------------------------------------------------------------------
    def _staging_for(self, layout: str) -> _Staged:
        with self._lock:
            if self._closed:
                raise KVMoveError("the PageSender is closed")
            staged = self._staged.get(layout)
            if staged is None:
                staged = _Staged(self.kv, layout, self.staging_slots, self.page_tokens,
                                 self.backend)
                if self._stream is not None:
                    self._warm_up(staged)
                self._staged[layout] = staged
            return staged

    def _warm_up(self, staged: _Staged) -> None:
        """Compile (or load) every gather kernel now, on rows and on page slots: launches
        that skip their only row (:meth:`PreparedCopy.warm_up`)."""
        with torch.cuda.stream(self._stream):
            for prepared in (staged.gather_all, *staged.gather_layer):
                prepared.warm_up()
        self._stream.synchronize()

    def _stage(self, staged: _Staged, places, pages: torch.Tensor, dst: np.ndarray,
               valid: np.ndarray, slots: np.ndarray, layer: int | None, ordered) -> SendJob:
        """Plan the spans of a piece and gather it into ``slots`` (given to the pages in
        destination order, so that consecutive destinations get consecutive slots)."""
        slot_of = np.empty_like(slots)
        slot_of[np.argsort(dst, kind="stable")] = slots
        plan = plan_spans(staged.places, places, slot_of, dst, valid, layer, self.page_tokens)
        t0 = time.perf_counter()
        gathered = None
        prepared = staged.gather_of(layer)
        slot_ids = torch.from_numpy(slot_of)
        if self._stream is None:
            copy_pages(prepared, pages, slot_ids, None)
        else:
            with torch.cuda.stream(self._stream):
                if ordered is not None:
                    self._stream.wait_event(ordered)
                copy_pages(prepared, pages, slot_ids, None)
                gathered = torch.cuda.Event()
                gathered.record(self._stream)
        return SendJob(plan, slots, layer, staged.slots, regions=staged.regions,
                       gathered=gathered, gather_s=time.perf_counter() - t0,
                       keep=staged.staging)

    def _unstage(self, staged: _Staged, job: SendJob | None, slots: np.ndarray,
                 layer: int | None) -> None:
        """Give back the slots of a piece that was not handed on."""
        if job is not None and job.gathered is not None:
            job.gathered.synchronize()  # the gather may still write the slots
        staged.slots.free(slots, layer)

    def _submit(self, peer: str, job: SendJob) -> bool:
        """Queue ``job`` on the link to ``peer``: a new link where there is none, or where
        the last one broke, is gone (its engine destroyed: about a second after the
        failure; a minute when the peer stopped answering at first contact) and its
        back-off has passed (:data:`RETRY_AFTER_S`, doubling with each link in a row that
        broke before a job went through, up to :data:`RETRY_AFTER_MAX_S`: a receiver that is
        gone costs an engine now and then, not one per send). Until then the peer counts
        as down: ``job`` ends ``FAILED`` (``NOT_SENT``) at once. False (nothing done with
        ``job``) once the sender is closed; :class:`kvmove.KVMoveError` when no engine can
        be made."""
        while True:
            with self._lock:
                if self._closed:
                    return False
                link = self._links.get(peer)
                if link is None:
                    link = self._links[peer] = PeerLink(peer, self.settings, self._watchdog)
                elif not link.accepting:
                    streak = 1 if link.jobs_ok else link.failed_before + 1
                    back_off = min(RETRY_AFTER_S * 2 ** (streak - 1), RETRY_AFTER_MAX_S)
                    if link.finished and time.monotonic() >= link.broken_at + back_off:
                        link = self._links[peer] = PeerLink(peer, self.settings,
                                                            self._watchdog)
                        link.failed_before = streak
                    else:
                        link = None
            if link is None:
                job.finish(NOT_SENT)
                job.release()
                return True
            if link.submit(job):
                return True


def _not_sent(transfer: Transfer, first: int, n: int, code: int, why: str) -> None:
    """Pages ``first..n`` of ``transfer`` end ``FAILED`` with ``code``: not tried."""
    left = n - first
    log.warning("%s: %d pages of the send not sent", why, left)
    transfer.add_piece(first, TransferResult([Status.FAILED] * left, [code] * left, 0))


def _check_layer(layers, num_layers: int, name: str = "layers") -> int | None:
    """``None`` (every layer) or one layer index in ``0 .. num_layers - 1``: ``TypeError``
    for anything else, ``IndexError`` out of range."""
    if layers is None:
        return None
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)):
        raise TypeError(f"{name} must be None or an int, got {layers!r:.40}")
    if not 0 <= layers < num_layers:
        raise IndexError(f"{name} = {layers} is out of range 0..{num_layers - 1}")
    return int(layers)


def _padded_page_lengths(pages: np.ndarray, name: str) -> np.ndarray:
    """Tokens of each page of int ``[n, page_tokens]`` token slots whose padding (``-1``)
    may only end a page: ``ValueError`` naming the page for a page that starts with
    ``-1`` or has a token after a ``-1``."""
    real = pages >= 0
    if not pages.shape[0]:
        return np.zeros(0, dtype=np.int64)
    empty = np.flatnonzero(~real[:, 0])
    if empty.size:
        raise ValueError(f"{name}[{int(empty[0])}] starts with -1: a page holds at least one "
                         "token (-1 pads the end of a partial page)")
    gaps = np.flatnonzero((real[:, 1:] & ~real[:, :-1]).any(axis=1))
    if gaps.size:
        i = int(gaps[0])
        raise ValueError(f"{name}[{i}] = {pages[i].tolist()} has a token after a -1: -1 "
                         "pads only the end of a page")
    return real.sum(axis=1, dtype=np.int64)


def _check_page_numbers(value, n: int, num_pages: int, name: str) -> np.ndarray:
    """``n`` distinct page numbers in ``0 .. num_pages - 1`` as int64: ``ValueError`` for
    another count or a page named twice, ``IndexError`` for one out of range."""
    pages = as_int_array(value, name)
    if pages.size != n:
        raise ValueError(f"{name} has {pages.size} pages for {n}")
    out = np.flatnonzero((pages < 0) | (pages >= num_pages))
    if out.size:
        i = int(out[0])
        raise IndexError(f"{name}[{i}] = {int(pages[i])} is outside pages 0..{num_pages - 1}")
    kept = np.sort(pages)
    twice = kept[1:][kept[1:] == kept[:-1]]
    if twice.size:
        raise ValueError(f"{name} names page {int(twice[0])} more than once")
    return pages
