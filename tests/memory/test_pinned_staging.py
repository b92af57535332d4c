"""Pinned staging memory, observed without a GPU through an injected registration hook: one
registration per region (no span crosses a registration), unregistered before unmapping
(also when a staging is dropped without ``close()``), resident from the start, not inherited
by forked children, and ``close()`` refusing while transfers hold slots."""

from __future__ import annotations

import ctypes
import gc
import resource
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import kvmove
from kvmove.memory import host_memory
from tests.support.caches import make_layers
from tests.support.staging_data import spans_crossing


def mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class RecordingPinning:
    """Registers nothing; records each call and whether the memory was mapped then."""

    def __init__(self):
        self.events: list[tuple[str, int, int, bool]] = []

    def register(self, address: int, nbytes: int) -> int:
        self.events.append(("register", address, nbytes, mapped(address)))
        return address

    def unregister(self, address: int) -> None:
        self.events.append(("unregister", address, 0, mapped(address)))

    def registered(self) -> set[int]:
        live = set()
        for op, address, _, _ in self.events:
            (live.add if op == "register" else live.discard)(address)
        return live


@pytest.fixture
def pinning(monkeypatch):
    hook = RecordingPinning()
    monkeypatch.setattr(host_memory, "pinning_for", lambda device: hook)
    return hook


def small_cache():
    return kvmove.KVCache({"kv": make_layers(3, 32, 656, torch.uint8),
                           "ix": make_layers(2, 32, 132, torch.uint8)})


def test_each_region_is_registered_once_and_no_span_crosses_a_registration(pinning):
    staging = kvmove.StagingBuffer(small_cache(), num_slots=6, page_tokens=4, trailer_bytes=8)
    assert staging.pinned
    regions = staging.regions()
    assert staging.registrations == regions  # one registration per region, itself
    assert [(a, n) for op, a, n, _ in pinning.events if op == "register"] == regions
    ranges = staging.registrations
    # Store spans: every span of every key, partial pages included.
    for valid in (None, 3):
        desc = kvmove.describe(staging, [5, 0, 1, 2], ["a", "b", "c", "d"], valid_tokens=valid)
        spans = [(p, n) for ptrs, sizes in zip(desc.ptrs, desc.sizes, strict=True)
                 for p, n in zip(ptrs, sizes, strict=True)]
        assert spans and spans_crossing(spans, ranges) == []
    # Two-hop copies: a 2-D copy covers every layer of one buffer, from its first byte on.
    extents = [(staging.tensor(n).data_ptr(), staging.tensor(n).numel())
               for n in staging.buffer_names]
    assert spans_crossing(extents, ranges) == []
    # The check itself: a span over the end of one region into whatever follows crosses.
    a, n = ranges[0]
    assert spans_crossing([(a + n - 4, 8)], ranges) == [(a + n - 4, 8)]


def test_allocations_are_never_adjacent():
    memories = [host_memory.HostMemory(4096 * k, pin=False) for k in (1, 2, 3)]
    ends = {m.address + m.nbytes for m in memories}
    assert not ends & {m.address for m in memories}
    assert all(mapped(m.address + m.nbytes) for m in memories)  # the spare page


def test_dropping_a_staging_without_close_unregisters_before_unmapping(pinning):
    staging = kvmove.StagingBuffer(small_cache(), num_slots=4, page_tokens=4, trailer_bytes=8)
    addresses = [a for a, _ in staging.regions()]
    assert pinning.registered() == set(addresses)
    del staging
    gc.collect()
    unregistered = [(a, was_mapped) for op, a, _, was_mapped in pinning.events
                    if op == "unregister"]
    assert sorted(a for a, _ in unregistered) == sorted(addresses)
    assert all(was_mapped for _, was_mapped in unregistered), "unregistered after unmapping"
    assert not any(mapped(a) for a in addresses), "the memory was never unmapped"


def test_close_unregisters_once(pinning):
    staging = kvmove.StagingBuffer(small_cache(), num_slots=4, page_tokens=4)
    staging.close()
    assert not staging.pinned and staging.registrations == [] and pinning.registered() == set()
    count = len(pinning.events)
    staging.close()
    del staging
    gc.collect()
    assert len(pinning.events) == count  # neither a second close nor the finaliser again


def test_close_refuses_while_slots_are_allocated(pinning):
    staging = kvmove.StagingBuffer(small_cache(), num_slots=4, page_tokens=4)
    slots = staging.alloc(2)
    with pytest.raises(kvmove.StagingInUse, match="2 of 4 slots"):
        staging.close()
    assert staging.pinned and len(pinning.registered()) == 2  # nothing was unpinned
    assert isinstance(kvmove.StagingInUse("x"), kvmove.KVMoveError)
    # With a timeout, close waits for the transfer to return its slots.
    freer = threading.Timer(0.2, staging.free, args=(slots,))
    freer.start()
    t0 = time.monotonic()
    staging.close(timeout=10)
    freer.join()
    assert 0.1 < time.monotonic() - t0 < 10
    assert not staging.pinned and pinning.registered() == set()


def test_close_force_unpins_under_allocated_slots(pinning):
    staging = kvmove.StagingBuffer(small_cache(), num_slots=4, page_tokens=4)
    staging.alloc(1)
    with pytest.raises(kvmove.StagingInUse):
        staging.close(timeout=0.05)
    staging.close(force=True)
    assert not staging.pinned and pinning.registered() == set()


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="Linux: per-thread faults")
def test_host_memory_is_resident_when_made():
    """No page of new staging memory faults in when first written (as it would while
    serving): the mapping was populated when made."""
    pages = 256
    memory = host_memory.HostMemory(pages * host_memory.PAGE, pin=False)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ctypes.memset(memory.address, 0x5A, memory.nbytes)  # every page, on this thread
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < pages // 8, f"{faults} of {pages} pages faulted in on first write"
    assert bytes(memory.tensor[:: host_memory.PAGE].tolist()) == b"\x5a" * pages
    memory.close()


def test_staging_memory_is_not_inherited_by_forked_children():
    memory = host_memory.HostMemory(3 * 4096 + 5, pin=False)
    assert "dc" in vm_flags(memory.address)  # MADV_DONTFORK: "do not copy area on fork"
    script = textwrap.dedent("""
        import ctypes, os, signal, sys
        from kvmove.memory.host_memory import HostMemory
        m = HostMemory(1 << 20, pin=False)
        m.tensor[:] = 7
        pid = os.fork()
        if pid == 0:  # the child: the staging is not mapped here
            os._exit(ctypes.string_at(m.address, 1)[0])
        _, status = os.waitpid(pid, 0)
        assert int(m.tensor[12345]) == 7
        print("signal" if os.WIFSIGNALED(status) else "exit", os.WTERMSIG(status)
              if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["signal", "11"], f"the child read the staging: {out}"


def test_slot_allocator_waits_for_every_slot():
    from kvmove.memory.slot_allocator import SlotAllocator

    slots = SlotAllocator(3)
    assert slots.wait_all_free(0)
    got = slots.alloc(2)
    assert not slots.wait_all_free(0.05)
    threading.Timer(0.1, slots.free, args=(got,)).start()
    assert slots.wait_all_free(10)
    assert np.array_equal(slots.alloc(3).numpy(), [0, 1, 2])
