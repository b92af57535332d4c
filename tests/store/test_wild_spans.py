"""Raw descriptors that point outside registered memory are refused before Mooncake sees
them: a put or get of one used to kill the process with SIGSEGV. The wild calls
run in a child process, so that a crash fails the test instead of ending the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmove
from kvmove.memory.host_memory import HostMemory
from tests.support.memory_store import MemoryStore

pytestmark = pytest.mark.store

ROOT = Path(__file__).resolve().parents[2]

# The child: an embedded store, a region of 4096 registered bytes inside 8192 mapped ones
# (so "past the region" is mapped memory that is not registered), each wild call made and
# what happened printed as one JSON line; then a good put and get of other keys.
CHILD = r"""
import json, sys, torch, kvmove
from kvmove.memory.host_memory import HostMemory

def report(**kv):
    print(json.dumps(kv), flush=True)

store = kvmove.MooncakeStore.embedded()
memory = HostMemory(8192, pin=None)
base = memory.address
store.register([(base, 4096)])
cases = {
    "unmapped": ([[0x1000]], [[64]], ()),
    "one_past": ([[base + 4096]], [[1]], ()),
    "overlap": ([[base + 4000]], [[200]], ()),
    "second_span": ([[base, 0x1000]], [[64, 64]], ()),
    "regions": ([[0x1000]], [[64]], [(0x1000, 4096)]),
}
for op in sys.argv[1].split(","):
    if op == "get":  # the objects exist, of the described sizes: a get would transfer
        keys = [f"wild-get-{case}" for case in cases]
        stored = store.put(kvmove.Descriptors(
            keys, [[base]] * len(keys), [[sum(c[1][0])] for c in cases.values()]))
        report(op="stored", result=str(list(stored)))
    for case, (ptrs, sizes, regions) in cases.items():
        key = f"wild-{op}-{case}"
        desc = kvmove.Descriptors([key], ptrs, sizes, regions=regions)
        try:
            if op == "pending":
                with store.begin_put([key]) as pending:
                    result = pending.put(desc)
            else:
                result = getattr(store, op)(desc)
            report(op=op, case=case, error=None, result=str(list(result)))
        except Exception as e:
            report(op=op, case=case, error=type(e).__name__, message=str(e))
good = [f"good-{i}" for i in range(3)]
src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
memory.tensor[:4096].copy_(src)
desc = kvmove.Descriptors(good[:1], [[base]], [[4096]])
put = store.put(desc)
memory.tensor[:4096].zero_()
got = store.get(desc)
ok = memory.tensor[:4096].equal(src)
staging = kvmove.StagingBuffer(kvmove.KVCache({"kv": torch.zeros(2, 8, 16, dtype=torch.uint8)}),
                               num_slots=2, page_tokens=4)
staging.tensor("kv").fill_(9)
d2 = kvmove.describe(staging, [0], good[1:2])
put2 = store.put(d2)
staging.tensor("kv").zero_()
got2 = store.get(d2)
report(op="after", put=str(list(put) + list(put2)), get=str(list(got) + list(got2)),
       same=bool(ok) and bool((staging.tensor("kv")[:, 0] == 9).all()),
       exists=str(list(store.exists([f"wild-{o}-{c}" for o in ("put", "pending") for c in cases]))))
store.close()
"""


def run_child(ops: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, ops], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, (  # a negative code: killed by that signal
        f"child exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("ops", ["put", "get", "pending"])
def test_wild_spans_are_refused_and_the_store_still_works(ops):
    lines = run_child(ops)
    stored = [line for line in lines if line["op"] == "stored"]
    assert [line["result"] for line in stored] == ([str([kvmove.Status.OK] * 5)]
                                                   if ops == "get" else [])
    wild = [line for line in lines if line["op"] not in ("after", "stored")]
    assert [line["case"] for line in wild] == ["unmapped", "one_past", "overlap",
                                               "second_span", "regions"]
    for line in wild:
        assert line["error"] == "ValueError", line
        message = line["message"]
        if line["case"] == "regions":  # the descriptor's own region is refused first
            assert "0x1000 + 4096" in message, line
        else:
            assert f"wild-{ops}-{line['case']}" in message, line
            assert "does not lie inside" in message, line
    by_case = {line["case"]: line["message"] for line in wild}
    assert "0x1000 + 64 bytes" in by_case["unmapped"]
    assert "+ 1 bytes" in by_case["one_past"]
    assert "+ 200 bytes" in by_case["overlap"]
    assert "0x1000 + 64 bytes" in by_case["second_span"]
    (after,) = [line for line in lines if line["op"] == "after"]
    assert after["put"] == after["get"] == str([kvmove.Status.OK] * 2)
    assert after["same"] is True
    assert "True" not in after["exists"]  # no wild key was stored


@pytest.mark.parametrize("kind", ["mooncake", "memory"])
def test_register_refuses_memory_that_is_not_mapped(kind, request):
    store = request.getfixturevalue("store") if kind == "mooncake" else MemoryStore()
    for bad in ([(0x1000, 4096)], [(0x1000, 0)]):
        with pytest.raises(ValueError, match=r"region 0x1000 \+ (4096|0) bytes"):
            store.register(bad)
    registered = store._state.registered if kind == "mooncake" else store._registered
    assert 0x1000 not in registered


@pytest.fixture(params=["mooncake", "memory"])
def any_store(request):
    if request.param == "mooncake":
        return request.getfixturevalue("store")
    return MemoryStore()


def test_raw_descriptors_inside_registered_memory_round_trip(any_store, keyspace):
    memory = HostMemory(8192, pin=None)
    data = torch.randint(0, 256, (8192,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3))
    memory.tensor.copy_(data)
    any_store.register([(memory.address, 8192)])
    try:
        a, b = keyspace(2, "raw")
        base = memory.address
        desc = kvmove.Descriptors([a, b], [[base, base + 8000], [base + 4096]],
                                  [[100, 192], [4096]])
        assert list(any_store.put(desc)) == [kvmove.Status.OK] * 2
        memory.tensor.zero_()
        assert list(any_store.get(desc)) == [kvmove.Status.OK] * 2
        for start, n in ((0, 100), (8000, 192), (4096, 4096)):
            assert torch.equal(memory.tensor[start:start + n], data[start:start + n])
        # A raw descriptor's own regions= are registered for it (checked: mapped memory)
        other = HostMemory(4096, pin=None)
        other.tensor.fill_(5)
        (c,) = keyspace(1, "own")
        own = kvmove.Descriptors([c], [[other.address]], [[4096]],
                                 regions=[(other.address, 4096)])
        assert list(any_store.put(own)) == [kvmove.Status.OK]
    finally:
        any_store.unregister([(memory.address, 8192)])


def test_a_wild_span_sends_no_key_of_the_call(any_store, keyspace):
    """Mapped memory past a registered region: refused, and the good key beside it unsent."""
    memory = HostMemory(8192, pin=None)
    any_store.register([(memory.address, 4096)])
    try:
        good, wild = keyspace(2, "mixed")
        desc = kvmove.Descriptors([good, wild], [[memory.address], [memory.address + 4095]],
                                  [[64], [2]])
        with pytest.raises(ValueError, match=rf"{wild}.*{memory.address + 4095:#x} \+ 2 bytes"):
            any_store.put(desc)
        with pytest.raises(ValueError, match=wild):
            any_store.get(desc)
        assert list(any_store.exists([good, wild])) == [False, False]
        # a describe()d descriptor with a trailer outside its staging is checked like a raw one
        staging = kvmove.StagingBuffer(
            kvmove.KVCache({"kv": torch.zeros(1, 8, 16, dtype=torch.uint8)}),
            num_slots=2, page_tokens=4)
        trailed = kvmove.describe(staging, [0], [good]).with_trailer([memory.address + 4096], 8)
        assert not trailed.vouched
        with pytest.raises(ValueError, match=rf"{memory.address + 4096:#x} \+ 8 bytes"):
            any_store.put(trailed)
        assert list(any_store.exists([good])) == [False]
    finally:
        any_store.unregister([(memory.address, 4096)])
