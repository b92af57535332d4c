"""``Request``: one evict or prefetch, validated once, when it is called, with what its
background work needs (a copy of the indices, on CUDA an event after the caller's work).
The rules are ``docs/API.md``, "KVMover"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvmove.checks import (
    INDEX_NUMPY_DTYPES,
    as_index_tensor,
    check_index_array,
    check_keys,
    check_range,
    check_unique,
    check_valid_tokens,
    small_rows_ok,
)
from kvmove.errors import KVMoveError
from kvmove.mover.lifecycle import Lifecycle


@dataclass(slots=True)
class Request:
    """A call's arguments, validated and taken at call time (or a piece of them)."""

    keys: list[str]
    # int64 [n, page_tokens]: a copy made at call time, numpy on the host, else a tensor on
    # the device
    pages: np.ndarray | torch.Tensor
    valid: np.ndarray  # int64 [n] valid tokens per key
    bad: np.ndarray | torch.Tensor | None  # bool [n]: a row of the key's page out of range
    ordered: object = None  # CUDA event after the caller's work at call time
    detect_exists: bool | None = None  # an evict's, for the store's put (None: its default)
    wait_for_staging: bool = True  # an evict's: False, it never waits for staging slots
    layerwise: bool = False  # a prefetch's: scattered group of layers by group
    # device pages: the KV cache's row limit, checked on the mover's stream (check_on_device)
    limit: int = 0
    _bad_host: torch.Tensor | None = None
    _pages_host: torch.Tensor | None = None

    def piece(self, first: int, last: int) -> Request:
        bad = None if self.bad is None else self.bad[first:last]
        return Request(self.keys[first:last], self.pages[first:last], self.valid[first:last],
                       bad, self.ordered, self.detect_exists, limit=self.limit)

    @property
    def put_options(self) -> dict:
        """The keyword arguments of the store's put for these keys."""
        return {} if self.detect_exists is None else {"detect_exists": self.detect_exists}

    def index_tensor(self) -> torch.Tensor:
        """``pages`` as a tensor (the copy kernels' index argument), sharing its memory."""
        pages = self.pages
        return torch.from_numpy(pages) if isinstance(pages, np.ndarray) else pages

    def check_on_device(self) -> None:
        """Device pages: ``bad`` (the keys with a row out of range) made on the current
        stream, the mover's (after the caller's event), not by kernels on the caller's
        thread at call time."""
        if self.limit and self.bad is None and len(self.keys):
            pages = self.pages
            self.bad = ((pages < -1) | (pages >= self.limit)).any(dim=1)

    def fetch_bad(self) -> None:
        """Enqueue the copy of a device ``bad`` mask to the host (on the current stream)."""
        if isinstance(self.bad, torch.Tensor):
            self._bad_host = self.bad.to("cpu", non_blocking=True)

    def fetch_pages(self) -> None:
        """Enqueue the copy of device ``pages`` to the host (on the current stream)."""
        if not isinstance(self.pages, np.ndarray):
            self._pages_host = self.pages.to("cpu", non_blocking=True)

    def pages_on_host(self) -> np.ndarray:
        """``pages`` on the host: after :meth:`fetch_pages` and a wait for the stream."""
        pages = self.pages
        return pages if isinstance(pages, np.ndarray) else self._pages_host.numpy()

    def bad_on_host(self) -> np.ndarray | None:
        """``bad`` on the host: after :meth:`fetch_bad` and a wait for the stream."""
        if isinstance(self.bad, torch.Tensor):
            return self._bad_host.numpy()
        if self.limit and self._pages_host is not None:  # device pages, fetched: checked here
            host = self._pages_host.numpy()
            out = ((host < -1) | (host >= self.limit)).any(axis=1)
            return out if out.any() else None
        return self.bad


class RequestTaker:
    """Makes the :class:`Request` of each call of one mover (what it checks against is
    fixed when the mover is built)."""

    def __init__(self, *, life: Lifecycle, device: torch.device, page_tokens: int,
                 num_slots: int, check: bool, evict_stream, prefetch_stream):
        self._life = life  # a closed mover refuses calls
        self.device = device
        self.page_tokens = page_tokens
        self.num_slots = num_slots  # the KV cache's: the limit of a row number
        self.check = check
        self.evict_stream = evict_stream  # CUDA only, else None
        self.prefetch_stream = prefetch_stream

    def _host_view(self, token_pages) -> np.ndarray | None:
        """A CPU mover's fast path: ``token_pages``, a plain CPU tensor of int32/int64 in two
        dimensions, as a numpy view (each torch attribute read costs a µs or two on a
        caller's thread that a copy just left cold; numpy's are cheaper). ``None`` for
        anything else: :func:`as_index_tensor` takes it, or names what is wrong."""
        if self.evict_stream is not None or type(token_pages) is not torch.Tensor:
            return None
        try:
            view = token_pages.numpy()  # raises for a device tensor
        except (TypeError, RuntimeError):
            return None
        if view.ndim != 2 or view.dtype not in INDEX_NUMPY_DTYPES:
            return None
        return view

    def take(self, keys, token_pages, valid_tokens, gathering: bool,
             detect_exists: bool | None = None, wait_for_staging: bool = True,
             layerwise: bool = False) -> Request:
        """Validate a call's arguments (raising before anything moves) and take them:
        ``gathering`` for an evict (its destinations are staging slots: no uniqueness
        check), else a prefetch."""
        if wait_for_staging is not True and wait_for_staging is not False:
            raise TypeError(f"wait_for_staging must be a bool, got {wait_for_staging!r}")
        if detect_exists is not None and not isinstance(detect_exists, bool):
            raise TypeError(f"detect_exists must be None or a bool, got {detect_exists!r}")
        if self._life.closed:
            raise KVMoveError("the KVMover is closed")
        keys = check_keys(keys)
        n = len(keys)
        if isinstance(token_pages, np.ndarray):  # taken as it is, no tensor made
            pages = check_index_array(token_pages, "token_pages", dim=2)
        elif (pages := self._host_view(token_pages)) is None:
            pages = as_index_tensor(token_pages, "token_pages", dim=2, device=self.device)
        if pages.shape[0] != n:
            raise ValueError(f"token_pages has {pages.shape[0]} pages for {n} keys")
        if n and pages.shape[1] != self.page_tokens:
            raise ValueError(
                f"token_pages has {pages.shape[1]} tokens per page, the mover's "
                f"page_tokens is {self.page_tokens}"
            )
        valid = check_valid_tokens(valid_tokens, n, self.page_tokens)
        if valid.flags.writeable:  # may be the caller's memory, which it may reuse at once
            valid = valid.copy()
        limit = self.num_slots
        device_limit = 0
        if isinstance(pages, torch.Tensor) and pages.is_cuda:
            # copied on the caller's stream (one copy, no host read); the range check runs
            # where the work does, on the mover's stream (Request.check_on_device)
            pages = pages.to(torch.int64, copy=True)
            bad, device_limit = None, limit
        else:  # kept as numpy: a torch tensor is made only where a copy kernel needs one
            if isinstance(pages, torch.Tensor):
                pages = pages.numpy()
            host = pages.astype(np.int64, copy=True)  # the engine may reuse its own
            bad = None
            if n and self.check:
                if not small_rows_ok(host, limit, unique=not gathering):
                    checked = torch.from_numpy(host)
                    check_range(checked, limit, "token_pages")  # raises, naming the bad one
                    if not gathering:
                        check_unique(checked, "token_pages")
            elif n:
                out = ((host < -1) | (host >= limit)).any(axis=1)
                bad = out if out.any() else None
            pages = host
        ordered = None
        if self.evict_stream is not None:  # on CUDA
            caller = torch.cuda.current_stream(self.device)
            ordered = torch.cuda.Event()
            ordered.record(caller)
            # device indices: made on the caller's stream, used on the mover's
            if isinstance(pages, torch.Tensor):
                stream = self.evict_stream if gathering else self.prefetch_stream
                pages.record_stream(stream)
        return Request(keys, pages, valid, bad, ordered, detect_exists, wait_for_staging,
                       layerwise, device_limit)
