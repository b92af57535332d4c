"""Row copies in host memory by numpy, for the torch backend: per layer one ``take`` of
units into a run of units (a gather) or one indexed assignment into scattered units (a
scatter), ``memcpy`` per unit without the GIL. :func:`threads_for` says whether numpy beats
torch's calls for a copy and over how many threads, from how torch's OpenMP threads wait
(read as they were when torch loaded). Both sides must be host memory whose units are one
contiguous block per layer (:meth:`BufferRows.unit_arrays`). A split copy returns, or
raises a part's error, only once every part has ended; only copies between pools apart are
split.
"""

from __future__ import annotations

import functools
import os
import queue
import re
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvmove.memory.row_pool import BufferRows
from kvmove.rows.torch_backend.openmp_environ import as_torch_loaded

# Measured on 2 vCPUs, 8 layers, 132-16384-byte units, numpy against torch's calls: with
# threads that sleep (OMP_WAIT_POLICY=passive, a zero GOMP_SPINCOUNT / KMP_BLOCKTIME), every
# parallel region wakes them, and numpy takes 0.1-0.7x torch's time up to about 1 MiB a
# layer on the calling thread, split over torch's thread count 0.6-0.85x at 1-4 MiB and
# 0.95x at 16 MiB (memory-bound); with one torch thread 0.65-1.0x at every size; with
# threads that spin (the default) 0.7-0.75x up to 64 KiB a layer, 1.25-1.9x past it.
# With threads that spin, numpy copies layers of up to this many bytes (back to back,
# 8 layers: 0.7-0.75x torch's time at 33-64 KiB a layer, 1.25-1.55x at 132-164 KiB).
SPINNING_THREADS_MAX_BYTES = 64 << 10
# A copy of at least this many bytes (all layers) is split over torch's thread count, at
# least this many bytes a thread (one part each: more parts measured slower, 0.7-1.0x).
SPLIT_MIN_BYTES = 1 << 20


@functools.cache
def _threads_sleep() -> bool:
    """Whether torch's OpenMP threads sleep as soon as a parallel region ends:
    :func:`threads_sleep` of the variables as they were when torch loaded (the runtime reads
    them once, then: a variable set later changes nothing there, and must change nothing
    here), for the runtime this process loaded."""
    return threads_sleep(as_torch_loaded(), _loaded_spin_variables())


def threads_spin() -> bool:
    """Whether torch runs parallel regions on threads that spin between them (torch's
    default): a parallel copy then starts on threads already awake."""
    return torch.get_num_threads() > 1 and not _threads_sleep()


# Each OpenMP runtime's own spin setting: libgomp (torch's pip wheels), LLVM and Intel
# OpenMP; and the grammar of the values it takes (a value it refuses leaves the policy to
# decide).
SPIN_VARIABLES = {
    "GOMP_SPINCOUNT": re.compile(r"(\d+)\s*[kmgt]?"),
    "KMP_BLOCKTIME": re.compile(r"(\d+)\s*(?:ms|us|s)?"),
}
_RUNTIME_LIBRARIES = {"GOMP_SPINCOUNT": ("libgomp",), "KMP_BLOCKTIME": ("libiomp5", "libomp")}


def _loaded_spin_variables() -> tuple[str, ...]:
    """The spin variables of the OpenMP runtimes mapped into this process (all of them
    where the process's maps cannot be read)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            text = maps.read()
    except OSError:
        return tuple(SPIN_VARIABLES)
    return tuple(name for name, libraries in _RUNTIME_LIBRARIES.items()
                 if any(f"/{lib}" in text for lib in libraries))


def threads_sleep(environ, spin_variables=tuple(SPIN_VARIABLES)) -> bool:
    """Whether an OpenMP runtime started under ``environ`` lets its threads sleep at once:
    its own spin setting (``spin_variables``) where set to a value it takes (zero: sleep;
    libgomp reads ``OMP_WAIT_POLICY`` only where ``GOMP_SPINCOUNT`` is not set), else
    ``OMP_WAIT_POLICY=passive`` (libgomp spins about 3 ms first when no policy is given)."""
    for name in spin_variables:
        value = environ.get(name, "").strip().lower()
        if value in ("infinite", "infinity"):
            return False
        taken = SPIN_VARIABLES[name].fullmatch(value)
        if taken is not None:
            return int(taken.group(1)) == 0
    return environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


def threads_for(layer_bytes: int, layers: int) -> int:
    """How many threads share a host copy of ``layer_bytes`` in each of ``layers`` layers
    (1: the calling thread alone); 0 where torch's calls are faster."""
    threads = torch.get_num_threads()  # once: threads_spin() asks it too
    if threads > 1 and not _threads_sleep():  # threads_spin()
        return 1 if layer_bytes <= SPINNING_THREADS_MAX_BYTES else 0
    return max(1, min(threads, layer_bytes * layers // SPLIT_MIN_BYTES))


def host_arrays(src: BufferRows, dst: BufferRows, unit: int
                ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]] | None:
    """Both sides' per-layer unit arrays (:meth:`BufferRows.unit_arrays`: host memory,
    contiguous per layer), or None where either side has none."""
    src_arrays = src.unit_arrays(unit)
    dst_arrays = dst.unit_arrays(unit) if src_arrays is not None else None
    return None if dst_arrays is None else (src_arrays, dst_arrays)


def take_into_run(src: tuple[np.ndarray, ...], dst: tuple[np.ndarray, ...],
                  layers: tuple[int, ...], src_units: np.ndarray, start: int,
                  threads: int = 1, *, apart: bool) -> None:
    """``dst[l][start + i] = src[l][src_units[i]]`` in each layer ``l`` of ``layers``, the
    units shared out over ``threads`` threads where the two pools are ``apart``
    (:meth:`BufferRows.apart_from`; else on this thread). ``src_units`` must be in range
    (it is not checked again: ``clip`` mode writes ``out`` directly, where ``raise`` mode
    would copy through a buffer)."""
    count = len(src_units)
    if threads < 2 or not apart or count < 2:  # on this thread: no split to set up
        end = start + count
        for i in layers:
            # the method, not np.take: one call, no dispatch through fromnumeric; positional
            # (axis, out, mode): no keywords to parse (0.3 us less per 8 layers)
            src[i].take(src_units, 0, dst[i][start:end], "clip")
        return

    def copy(a: int, b: int) -> None:
        units = src_units[a:b]
        for i in layers:
            src[i].take(units, 0, dst[i][start + a:start + b], "clip")

    _run_split(copy, count, threads)


def put_units(src: tuple[np.ndarray, ...], dst: tuple[np.ndarray, ...],
              layers: tuple[int, ...], src_units: np.ndarray | None, src_start: int | None,
              dst_units: np.ndarray, threads: int = 1, *, apart: bool) -> None:
    """``dst[l][dst_units[i]] = src[l][...]`` in each layer ``l`` of ``layers``, from the
    run of units at ``src_start`` or from ``src_units`` (when ``src_start`` is None), the
    units shared out over ``threads`` threads where the two pools are ``apart``
    (:meth:`BufferRows.apart_from`; else on this thread). Every destination unit is written
    once (distinct ``dst_units``); numpy reads a source that overlaps the destination
    first, within one call: never across the parts of a split copy."""
    threads = threads if apart else 1

    def copy(a: int, b: int) -> None:
        to = dst_units[a:b]
        if src_start is not None:
            for i in layers:
                dst[i][to] = src[i][src_start + a:src_start + b]
        else:
            taken = src_units[a:b]
            for i in layers:
                dst[i][to] = src[i][taken]

    _run_split(copy, len(dst_units), threads)


def _run_split(copy: Callable[[int, int], None], count: int, threads: int) -> None:
    """``copy(a, b)`` over ``0 .. count`` in ``threads`` even ranges: the first here, the
    others queued for helpers and run here where no helper has started one. Returns, or
    raises the first part's error, once every part has ended: no part writes after."""
    # Helper threads start on first use, as many as torch has threads, less one; the caller
    # runs any part no helper has started, so a call never waits behind another call's work.
    # Two pools over the same tensors copy on one thread: numpy reads an overlapping source
    # first within one call only.
    parts = min(count, threads)
    if parts <= 1:
        copy(0, count)
        return
    edges = [count * k // parts for k in range(parts + 1)]
    split = [_Part(copy, edges[k], edges[k + 1]) for k in range(parts)]
    _helpers.hand_out(split[1:], threads - 1)
    for part in split:
        part.run()  # this thread's part, then any no helper has started
    errors = [part.wait() for part in split]
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


class _Part:
    """One range of a split copy: run by whichever thread claims it first."""

    __slots__ = ("_args", "_claim", "_copy", "_done", "_error")

    def __init__(self, copy: Callable[[int, int], None], a: int, b: int):
        self._copy, self._args = copy, (a, b)
        self._claim = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return  # another thread has it
        try:
            self._copy(*self._args)
        except BaseException as e:  # raised on the calling thread (_run_split)
            self._error = e
        finally:
            self._done.set()

    def wait(self) -> BaseException | None:
        """Wait until the part has ended; what it raised, or None."""
        self._done.wait()
        return self._error


class _Helpers:
    """Daemon threads that run queued parts; started as parts need them, or before
    (:func:`start_helpers`; a forked child starts its own)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Part] = queue.SimpleQueue()
        self._count = 0

    def hand_out(self, parts: list[_Part], helpers: int) -> None:
        """Queue ``parts`` for helper threads, starting up to ``helpers`` of them. Where no
        helper runs (none could be started: at interpreter shutdown, out of threads) nothing
        is queued: the caller runs every part."""
        self.start(helpers)
        if self._count:
            for part in parts:
                self._queue.put(part)

    def start(self, helpers: int) -> None:
        """Start helper threads until ``helpers`` run (fewer where none can be started)."""
        if self._count < helpers:
            with self._lock:
                while self._count < helpers:
                    thread = threading.Thread(target=self._serve, args=(self._queue,),
                                              daemon=True,
                                              name=f"kvmove-host-copy-{self._count + 1}")
                    try:
                        thread.start()
                    except RuntimeError:
                        break
                    self._count += 1

    @staticmethod
    def _serve(work: queue.SimpleQueue) -> None:
        while True:
            work.get().run()


_helpers = _Helpers()


def start_helpers() -> None:
    """Start the helper threads that split copies use (torch's thread count less one, where
    torch's threads sleep: the only case that splits), for a caller about to serve: the copy
    that started one paid ~0.1 ms for it."""
    if not threads_spin():
        _helpers.start(torch.get_num_threads() - 1)
