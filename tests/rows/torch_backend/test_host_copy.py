"""The torch backend's numpy copies in host memory (:mod:`kvmove.rows.torch_backend.host_copy`):
on the calling thread, split over helper threads, or left to torch's calls, gathers, scatters and
copies inside one pool write the same bytes, equal to a per-row reference; a split copy
runs every part once, finishes where no helper runs, raises a part's error on the caller
and works in a forked child; the choice follows how torch's threads wait."""

from __future__ import annotations

import os
import threading
import time
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from kvmove.rows.torch_backend import host_copy
from tests.support.caches import assert_same, buffer_specs, build_cache, fill_random, snapshot

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# threads_for's answers: torch's calls, numpy on the calling thread, numpy over 3 threads
CHOICES = (0, 1, 3)


def forced(threads: int):
    """Every copy of the torch backend takes this choice, whatever its size."""
    return mock.patch("kvmove.rows.torch_backend.reference.threads_for", lambda *_: threads)


@st.composite
def pages_and_slots(draw, kv_slots: int, page_tokens: int, staging_slots: int):
    """``(token_pages, slots)``: whole aligned pages or scattered distinct rows, into
    distinct slots (a run or not)."""
    aligned = kv_slots // page_tokens
    n = draw(st.integers(1, min(staging_slots, max(aligned, 1))))
    if aligned >= n and draw(st.booleans()):
        firsts = torch.tensor(draw(st.permutations(range(aligned)))[:n]) * page_tokens
        pages = firsts[:, None] + torch.arange(page_tokens)
    else:
        rows = draw(st.lists(st.integers(-1, kv_slots - 1), min_size=n * page_tokens,
                             max_size=n * page_tokens))
        pages = torch.tensor(rows).view(n, page_tokens)
    first = draw(st.integers(0, staging_slots - n))
    slots = (torch.arange(first, first + n) if draw(st.booleans())
             else torch.tensor(draw(st.permutations(range(staging_slots)))[:n]))
    return pages, slots


def layer_list(layers, count: int) -> list[int]:
    if layers is None:
        return list(range(count))
    return [layers] if isinstance(layers, int) else list(layers)


@SETTINGS
@given(data=st.data(), specs=buffer_specs(max_buffers=2, max_layers=4),
       page_tokens=st.sampled_from([1, 2, 4, 16]), kv_slots=st.integers(4, 96))
def test_every_host_copy_choice_writes_the_same_bytes(data, specs, page_tokens, kv_slots):
    kv = build_cache(specs, kv_slots, seed=data.draw(st.integers(0, 100)))
    staging_slots = data.draw(st.integers(1, 6))
    pages, slots = data.draw(pages_and_slots(kv_slots, page_tokens, staging_slots))
    layers = data.draw(st.one_of(st.none(), st.integers(0, kv.max_layers - 1),
                                 st.just(sorted({0, kv.max_layers - 1}))))
    # Where the scatter goes: distinct rows of another cache, -1 where the page was padding.
    dst = torch.tensor(data.draw(st.permutations(range(kv_slots))))
    dst = torch.cat([dst, torch.full((pages.numel(),), -1)])[:pages.numel()].view_as(pages)
    dst[pages < 0] = -1
    results = []
    for threads in CHOICES:
        staging = kvmove.StagingBuffer(kv, num_slots=staging_slots, page_tokens=page_tokens)
        fill_random(staging, seed=5)
        staged_before = snapshot(staging)
        other = build_cache(specs, kv_slots, seed=200)
        other_before = snapshot(other)
        with forced(threads):
            staged_rows = (slots[:, None] * page_tokens + torch.arange(page_tokens)).reshape(-1)
            kvmove.copy_rows(kv, pages.reshape(-1), staging, staged_rows, layers=layers,
                             backend="torch")
            kvmove.scatter(staging, slots, other, dst, layers=layers, backend="torch")
        # The reference, row by row.
        want_staged = {k: [t.clone() for t in v] for k, v in staged_before.items()}
        want_other = {k: [t.clone() for t in v] for k, v in other_before.items()}
        for name in kv.buffer_names:
            rb = kv.row_bytes(name)
            for layer in layer_list(layers, kv.num_layers(name)):
                if layer >= kv.num_layers(name):
                    continue
                source = kv.layer(name, layer)
                for p, slot in enumerate(slots.tolist()):
                    for t, (row, to) in enumerate(zip(pages[p].tolist(), dst[p].tolist(),
                                                      strict=True)):
                        if row >= 0:
                            want_staged[name][layer][slot, t * rb:(t + 1) * rb] = source[row]
                        if to >= 0:
                            want_other[name][layer][to] = source[row]
        assert_same(snapshot(staging), want_staged)
        assert_same(snapshot(other), want_other)
        results.append((snapshot(staging), snapshot(other)))
    for staged, scattered in results[1:]:
        assert_same(staged, results[0][0])
        assert_same(scattered, results[0][1])


@pytest.mark.parametrize("threads", CHOICES)
def test_a_copy_inside_one_pool_reads_every_row_before_it_writes(threads):
    """Overlapping source and destination rows of one cache (unchecked: ``check=True``
    refuses them): each destination gets its source row as it was before the call."""
    specs = [("kv", 2, 656, torch.uint8, 0, True), ("ix", 3, 132, torch.uint8, 0, False)]
    kv = build_cache(specs, 48, seed=8)
    before = snapshot(kv)
    src = torch.tensor([*range(0, 16), 40, 41])
    dst = torch.tensor([*range(8, 24), 41, 40])
    with forced(threads):
        kvmove.copy_rows(kv, src, kv, dst, backend="torch", check=False)
    for name, layers in before.items():
        for layer, rows in enumerate(layers):
            want = rows.clone()
            want[dst] = rows[src]
            assert torch.equal(kv.layer(name, layer), want), (name, layer)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_pools_over_the_same_tensors_read_every_row_before_it_is_written(direction):
    """Two caches over the same tensors are two pools (no ``check_disjoint``), and a copy
    between them may overlap itself: a split copy's parts would read rows another part
    writes, so such a copy runs on one thread and every destination gets its source row as
    it was before the call."""
    base = [torch.randint(0, 256, (96, 1, 656), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(i)) for i in range(2)]
    a, b = kvmove.KVCache({"kv": base}), kvmove.KVCache({"kv": base})
    run, scattered = torch.arange(20, 60), torch.arange(20, 60).flip(0)
    src, dst = (scattered, run) if direction == "gather" else (run, scattered)
    want = []
    for t in base:
        w = t.clone()
        w[dst] = t[src]
        want.append(w)
    with forced(3):
        kvmove.copy_rows(a, src, b, dst, backend="torch")
    assert all(torch.equal(t, w) for t, w in zip(base, want, strict=True))


def test_buffers_are_apart_only_where_no_layer_touches_another_sides_layer():
    """``BufferRows.apart_from`` (the split copy's guard) compares the layers' address
    spans: pools over the same tensors, or one whose layer starts inside another's last
    row, are not apart; separate tensors, or neighbours that only touch, are. The answer
    is the same both ways, and a second ask (cached) too."""
    def rows(*layers):
        return kvmove.KVCache({"kv": list(layers)}).row_pool.buffers["kv"]

    mem = torch.zeros(4, 64, 132, dtype=torch.uint8)
    a, b = rows(mem[0], mem[1]), rows(mem[2], mem[3])
    cases = [
        (a, rows(mem[0], mem[1]), False),  # the same tensors
        (a, b, True),  # neighbours in one storage
        (a, rows(mem[1], mem[2]), False),  # one layer shared
        (a, rows(mem.view(-1)[132 * 64 - 1:][:64 * 132].view(64, 132)), False),  # 1 byte in
        (a, rows(torch.zeros(64, 132, dtype=torch.uint8)), True),  # another allocation
    ]
    for x, y, want in cases:
        for _ in range(2):
            assert x.apart_from(y) is want and y.apart_from(x) is want


@pytest.mark.parametrize(("environ", "sleep"), [
    ({}, False),  # libgomp's default: spin about 3 ms first
    ({"OMP_WAIT_POLICY": " Passive "}, True),
    ({"OMP_WAIT_POLICY": "active"}, False),
    ({"GOMP_SPINCOUNT": "0"}, True),
    ({"GOMP_SPINCOUNT": "0k"}, True),
    ({"GOMP_SPINCOUNT": "300000"}, False),
    ({"GOMP_SPINCOUNT": "INFINITY"}, False),
    # the runtime's own setting wins over the policy (libgomp reads the policy only
    # where GOMP_SPINCOUNT is not set) ...
    ({"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "0"}, True),
    ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "INFINITY"}, False),
    # ... unless it refuses the value
    ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "abc"}, True),
    ({"GOMP_SPINCOUNT": "0x10"}, False),
    ({"GOMP_SPINCOUNT": "0.5"}, False),
    ({"KMP_BLOCKTIME": "0"}, True),
    ({"KMP_BLOCKTIME": "0ms"}, True),
    ({"KMP_BLOCKTIME": "200ms"}, False),
])
def test_threads_sleep_where_the_openmp_runtime_is_told_not_to_spin(environ, sleep):
    assert host_copy.threads_sleep(environ) is sleep


def test_only_the_loaded_runtimes_spin_setting_counts():
    """Another runtime's variable is not read: libgomp ignores ``KMP_BLOCKTIME``."""
    environ = {"KMP_BLOCKTIME": "0"}
    assert host_copy.threads_sleep(environ, ("GOMP_SPINCOUNT",)) is False
    assert host_copy.threads_sleep(environ, ("KMP_BLOCKTIME",)) is True
    loaded = host_copy._loaded_spin_variables()  # torch is imported: some runtime is
    assert loaded and set(loaded) <= set(host_copy.SPIN_VARIABLES)


def test_a_split_copy_runs_every_part_once_on_helpers_and_the_caller():
    seen, lock = [], threading.Lock()

    def copy(a: int, b: int) -> None:
        with lock:
            seen.append((a, b, threading.current_thread().name))

    for _ in range(20):
        seen.clear()
        host_copy._run_split(copy, 10, 4)
        assert sorted((a, b) for a, b, _ in seen) == [(0, 2), (2, 5), (5, 7), (7, 10)]
        assert (0, 2, threading.current_thread().name) in seen  # the first part: the caller


def test_a_split_copy_finishes_where_no_helper_runs():
    seen = []
    with mock.patch.object(host_copy._helpers, "hand_out", lambda parts, helpers: None):
        host_copy._run_split(lambda a, b: seen.append((a, b)), 9, 3)
    assert seen == [(0, 3), (3, 6), (6, 9)]


@pytest.mark.parametrize("failing", [0, 1])
def test_a_parts_error_is_raised_on_the_caller_once_every_part_has_ended(failing):
    """Whichever part raises (the caller's own, or one a helper runs), the call raises only
    after the other parts ended: none writes after the caller got the error."""
    ended = []

    def copy(a: int, b: int) -> None:
        if a // 3 == failing:
            raise ValueError(f"part at {a}")
        time.sleep(0.2)  # a slow part, still writing when the failing one raised
        ended.append(a)

    with pytest.raises(ValueError, match="part at"):
        host_copy._run_split(copy, 9, 3)
    assert sorted(ended) == [a for a in (0, 3, 6) if a // 3 != failing]


def test_a_copy_that_can_start_no_helper_runs_every_part_and_queues_none(monkeypatch):
    """A helper thread that cannot start (at interpreter shutdown on Python 3.12+, out of
    threads) leaves every part to the caller, and nothing waits in a queue no one reads."""
    helpers = host_copy._Helpers()
    monkeypatch.setattr(host_copy, "_helpers", helpers)

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    for _ in range(3):
        seen = []
        host_copy._run_split(lambda a, b, seen=seen: seen.append((a, b)), 6, 3)
        assert seen == [(0, 2), (2, 4), (4, 6)]
    assert helpers._queue.empty()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_helpers_of_its_own():
    host_copy._run_split(lambda a, b: None, 4, 2)  # the parent's helpers are running
    pid = os.fork()
    if pid == 0:  # the child: its helpers did not survive the fork
        code = 1
        try:
            names = []
            host_copy._run_split(
                lambda a, b: names.append(threading.current_thread().name) if a else None,
                8, 2)
            helpers = [t.name for t in threading.enumerate()
                       if t.name.startswith("kvmove-host-copy")]
            code = 0 if len(names) == 1 and helpers else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_choice_follows_how_torchs_threads_wait(monkeypatch):
    kib = 1 << 10
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: False)  # spinning threads
    assert host_copy.threads_for(64 * kib, 8) == 1
    assert host_copy.threads_for(64 * kib + 1, 8) == 0  # torch's threads are faster
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: True)  # sleeping threads
    assert host_copy.threads_for(64 * kib, 8) == 1  # 512 KiB in all: no split
    assert host_copy.threads_for(256 * kib, 8) == 2  # 2 MiB: two threads
    assert host_copy.threads_for(64 << 20, 8) == 4  # as many as torch has
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: False)
    assert host_copy.threads_for(64 << 20, 8) == 1  # one thread: numpy at any size


def test_one_select_for_every_layer_is_smaller_where_torchs_threads_spin(monkeypatch):
    """With threads awake, per-layer selects take a copy past 512 KiB (all layers) to them;
    with sleeping threads or one thread the one call keeps copies up to 4 MiB."""
    from kvmove.rows.torch_backend.reference import stacked_select_max_bytes
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: False)
    assert stacked_select_max_bytes() == 512 << 10
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: True)
    assert stacked_select_max_bytes() == 4 << 20
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(host_copy, "_threads_sleep", lambda: False)
    assert stacked_select_max_bytes() == 4 << 20


@pytest.mark.parametrize(("at_start", "later", "order", "sleep"), [
    # set after torch loaded its runtime: it spins all the same, whenever kvmove's modules
    # load (they load lazily)
    ("", "PASSIVE", "torch, kvmove, host_copy, set", False),
    ("", "PASSIVE", "torch, kvmove, set, host_copy", False),
    ("PASSIVE", "ACTIVE", "torch, kvmove, set, host_copy", True),
    ("", "PASSIVE", "kvmove, torch, set, host_copy", False),  # isort's order
    # set before torch loads (kvmove imported first): the runtime reads it
    ("", "PASSIVE", "kvmove, set, torch, host_copy", True),
    ("", "PASSIVE", "kvmove, set, host_copy", True),  # its import loads torch
    # a library looked for torch before (importlib.util.find_spec), then the import
    ("", "PASSIVE", "kvmove, find, set, torch, host_copy", True),
])
def test_how_threads_wait_is_read_from_the_environment_torch_loaded_with(at_start, later,
                                                                        order, sleep):
    """The OpenMP runtime reads its variables when torch loads it: a change made after that
    changes neither the runtime nor kvmove's choice; one made before it changes both."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    if at_start:
        env["OMP_WAIT_POLICY"] = at_start
    steps = {"torch": "import torch", "kvmove": "import kvmove",
             "find": "import importlib.util; importlib.util.find_spec('torch')",
             "host_copy": "from kvmove.rows.torch_backend import host_copy",
             "set": f"os.environ['OMP_WAIT_POLICY'] = {later!r}"}
    code = "\n".join(["import os", *(steps[s] for s in order.split(", ")),
                      "print(host_copy._threads_sleep())", ""])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == str(sleep)


def test_unit_arrays_view_host_rows_and_refuse_padded_ones():
    kv = build_cache([("kv", 3, 656, torch.float16, 0, True),
                      ("pad", 2, 132, torch.uint8, 4, False)], 32)
    dense, padded = kv.row_pool.buffers["kv"], kv.row_pool.buffers["pad"]
    assert padded.unit_arrays(1) is None  # a strided source numpy would copy whole
    arrays = dense.unit_arrays(4)
    assert [a.shape for a in arrays] == [(8, 4 * 656)] * 3
    arrays[1][2, :] = 7  # the same memory as the cache's rows 8..11 of layer 1
    assert bool((dense.layers[1][8:12] == 7).all())
    assert dense.unit_arrays(4) is arrays  # cached
    assert all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays)
