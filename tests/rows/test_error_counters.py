"""Error counters on the CPU: every call that returns one gets a zeroed int32 ``[1]`` of its
own, across blocks and threads, and counting into one changes no other."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import kvmove
from kvmove.rows import error_counters
from tests.support.caches import build_cache


def test_every_host_counter_is_fresh_zeroed_and_its_own():
    cpu = torch.device("cpu")
    counters = [error_counters.new_error_counter(cpu)
                for _ in range(error_counters.BLOCK * 2 + 5)]  # past two blocks
    assert all(c.shape == (1,) and c.dtype == torch.int32 and c.device == cpu
               for c in counters)
    assert len({c.data_ptr() for c in counters}) == len(counters)
    assert all(int(c) == 0 for c in counters)
    counters[0] += 7  # counting into one...
    assert int(counters[0]) == 7
    assert sum(int(c) for c in counters[1:]) == 0  # ... leaves the others at zero


def test_threads_never_share_a_host_counter():
    cpu = torch.device("cpu")
    got: list[list[torch.Tensor]] = [[] for _ in range(4)]

    def take(out):
        for _ in range(error_counters.BLOCK):
            out.append(error_counters.new_error_counter(cpu))

    threads = [threading.Thread(target=take, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [c for out in got for c in out]
    assert len({c.data_ptr() for c in every}) == len(every) == 4 * error_counters.BLOCK


def test_gathers_return_counters_of_their_own_bad_rows():
    kv = build_cache([("kv", 2, 656, torch.uint8, 0, True)], 16)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    bad = torch.tensor([[1], [99], [2], [77]])  # two rows out of range
    first = kvmove.gather(kv, staging, bad, torch.arange(4), backend="torch", check=False)
    clean = kvmove.gather(kv, staging, bad[[0, 2]], torch.arange(2), backend="torch",
                          check=False)
    second = kvmove.gather(kv, staging, bad, torch.arange(4), backend="torch", check=False)
    assert (int(first), int(clean), int(second)) == (2, 0, 2)


def test_host_counters_are_plain_cpu_tensors_whatever_the_context_of_a_refill():
    """A block made under inference mode or a default-device context still gives counters a
    call outside them can count into (and pass back as ``errors=``)."""
    cpu = torch.device("cpu")
    error_counters._host_counters.clear()  # the next call makes a block
    with torch.inference_mode(), torch.device("meta"):
        inside = error_counters.new_error_counter(cpu)
    after = error_counters.new_error_counter(cpu)  # from the block made inside
    for counter in (inside, after):
        assert counter.device == cpu and not counter.is_inference()
        counter += 1
        assert int(counter) == 1
    kv = build_cache([("kv", 2, 656, torch.uint8, 0, True)], 16)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=1)
    with torch.inference_mode():
        kvmove.gather(kv, staging, torch.tensor([[1], [99]]), torch.arange(2), backend="torch",
                      check=False)  # refills nothing, counts inside the mode
    out = kvmove.gather(kv, staging, torch.tensor([[99]]), torch.arange(1), backend="torch",
                        check=False, errors=after)
    assert out is after and int(after) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_hands_out_its_parents_counters():
    cpu = torch.device("cpu")
    shared = error_counters.new_error_counter(cpu)
    shared.share_memory_()  # the whole block moves to shared memory
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mine = error_counters.new_error_counter(cpu)
            mine += 5
            code = 0 if not mine.is_shared() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(error_counters.new_error_counter(cpu)) == 0
