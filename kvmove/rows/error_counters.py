"""Fresh error counters for the calls that return one, without an allocation and a fill
launch per call on a GPU, and without a torch call per call on the CPU.

A counter is one zeroed int32 on the call's device. On the CPU, counters are one-element
views of a zeroed block of them, all made with the block (``unbind``) and handed out once
each: a call takes one from a list (a torch factory call costs 1 µs hot, but about 30 µs
after the caches went cold, which is how an engine calls between its own work; measured).
On CUDA, counters are handed out as
one-element views of a zeroed block of them, made on the stream that uses them: the block
is allocated and filled in that stream's order (so every kernel counting into a view runs
after the fill), each view is handed out once, and the block's memory goes back to the
caching allocator, in that stream's order, once the last view is dropped. Under CUDA-graph
capture a counter is a plain ``torch.zeros``: the graph then zeroes it on every replay.
"""

from __future__ import annotations

import os
import threading

import torch

BLOCK = 1024  # counters per block (4 KiB)

_lock = threading.Lock()
_blocks: dict = {}  # (device index, raw stream) -> [block, next free index]
# The current stream's handle without making a Stream object (what Triton launches on).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_host_counters: list[torch.Tensor] = []  # zeroed views, each handed out once
# A forked child starts a pool of its own: a block a caller shared (share_memory_ moves the
# whole block) would otherwise hand the same counters out in both processes.
os.register_at_fork(after_in_child=_host_counters.clear)


def _host_counter() -> torch.Tensor:
    try:
        return _host_counters.pop()  # atomic: no two callers get the same view
    except IndexError:
        pass
    # Made as the plain CPU tensor any call may count into, whatever the caller's context at
    # refill time (an inference-mode block would refuse in-place adds outside that mode; a
    # default-device context would move it).
    with torch.inference_mode(False):
        views = list(torch.zeros(BLOCK, 1, dtype=torch.int32, device="cpu").unbind(0))
    counter = views.pop()
    _host_counters.extend(views)  # a racing refill adds its own block's views: none shared
    return counter


def new_error_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 ``[1]`` counter on ``device``, for the current stream's work."""
    if device.type == "cpu":
        return _host_counter()
    if device.type != "cuda":
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = torch.cuda.current_device()
    # Another device than the thread's (its capture state is not the one asked here), or a
    # capture: a plain counter.
    if device.index not in (None, index) or torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (index, torch.cuda.current_stream(index).cuda_stream
           if _raw_stream is None else _raw_stream(index))
    with _lock:
        entry = _blocks.get(key)
        if entry is None or entry[1] == BLOCK:
            if len(_blocks) > 64:  # streams come and go: keep the table small
                _blocks.clear()
            entry = _blocks[key] = [torch.zeros(BLOCK, dtype=torch.int32, device=device), 0]
        i = entry[1]
        entry[1] = i + 1
        return entry[0].narrow(0, i, 1)  # narrow: ~5 µs against ~7 for a slice (H200 host)
