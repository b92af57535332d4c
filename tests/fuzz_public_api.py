"""Hypothesis fuzzing of every public function's arguments, run as a child process by
tests/test_fuzz.py so that a crash (segfault, abort) is caught as a failure, not lost.

Every call must either succeed or raise a clear ``TypeError`` / ``ValueError`` /
``IndexError`` / ``KeyError`` / ``kvmove.KVMoveError``; after a rejected call every byte of
the KV cache and the staging is unchanged. ``check=False`` calls never raise for indices and
count exactly the out-of-range rows. Prints a JSON summary of the outcomes on its last line.

    python -m tests.fuzz_public_api --examples 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmove
from tests.support.caches import make_layers

REJECT = (TypeError, ValueError, IndexError, KeyError, kvmove.KVMoveError)
OUTCOMES: Counter = Counter()
KV_SLOTS, STAGING_SLOTS, PAGE = 24, 6, 4
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
OTHER_DTYPES = [torch.bool, torch.float32, torch.float64, torch.bfloat16]


def world():
    kv = kvmove.KVCache({"kv": make_layers(3, KV_SLOTS, 656, torch.uint8, seed=1),
                         "ix": make_layers(2, KV_SLOTS, 132, torch.float32, pitch_pad=1, seed=2)})
    staging = kvmove.StagingBuffer(kv, num_slots=STAGING_SLOTS, page_tokens=PAGE)
    for n in staging.buffer_names:
        staging.tensor(n).fill_(0x33)
    return kv, staging


KV, STAGING = world()


def memory() -> list[torch.Tensor]:
    """Every byte kvmove could touch: KV layers (with the padding between rows) and staging."""
    out = []
    for n in KV.buffer_names:
        for layer in range(KV.num_layers(n)):
            t = KV.layer(n, layer)
            out.append((t._base if t._base is not None else t).clone())
    out += [STAGING.tensor(n).clone() for n in STAGING.buffer_names]
    return out


def same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b, strict=True))


def outcome(name: str, fn) -> None:
    before = memory()
    try:
        fn()
    except REJECT as e:
        OUTCOMES[f"{name}: rejected {type(e).__name__}"] += 1
        assert same(before, memory()), f"{name} raised {e!r} after writing memory"
        assert str(e), f"{name} raised {type(e).__name__} without a message"
        return
    OUTCOMES[f"{name}: accepted"] += 1


big = st.integers(-(2**62), 2**62)


@st.composite
def indices(draw, shape, limit):
    """Index arguments of every kind: half of them valid (distinct in-range values or -1), the
    rest out of range, every dtype, NaN, non-contiguous, wrong device, wrong shape, Python
    lists, junk."""
    n = 1
    for s in shape:
        n *= s
    if draw(st.booleans()) and n <= limit:
        good = draw(st.permutations(list(range(limit))))[:n]
        good = [draw(st.sampled_from([v, v, -1])) for v in good]
        dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        return torch.tensor(good, dtype=dtype).reshape(shape)
    values = draw(st.lists(st.one_of(st.integers(-1, limit - 1), st.integers(-3, limit + 3), big),
                           min_size=n, max_size=n))
    kind = draw(st.sampled_from(["tensor", "tensor", "dtype", "float", "strided", "meta",
                                 "shape", "list", "junk"]))
    base = torch.tensor(values, dtype=torch.int64).reshape(shape)
    if kind == "tensor":
        return base.to(draw(st.sampled_from([torch.int32, torch.int64]))) if max(
            [abs(v) for v in values], default=0) < 2**31 else base
    if kind == "dtype":
        return base.to(draw(st.sampled_from(INT_DTYPES + OTHER_DTYPES)))
    if kind == "float":
        f = base.to(torch.float64)
        if f.numel():
            f.view(-1)[0] = float("nan")
        return f
    if kind == "strided":
        wide = torch.stack([base, base], dim=-1)
        return wide[..., 0]  # non-contiguous view
    if kind == "meta":
        return torch.empty(shape, dtype=torch.int64, device="meta")
    if kind == "shape":
        return base.reshape(-1) if len(shape) == 2 else base.reshape(1, -1)
    if kind == "list":
        return base.tolist()
    return draw(st.sampled_from([None, "0,1", 3.5, object(), {"a": 1}, b"\x00"]))


keys_strategy = st.one_of(st.lists(st.text(min_size=1, max_size=8), min_size=3, max_size=3,
                                    unique=True), st.lists(
    st.one_of(st.text(min_size=0, max_size=12), st.sampled_from(["", "a", "a", "k/1", "ключ",
                                                                  "x" * 300, " ", "\x00"]),
              st.integers(), st.none()),
    min_size=0, max_size=6))
backends = st.sampled_from(["torch", "triton", "auto", "cuda", "", None])
layers_arg = st.one_of(st.none(), st.integers(-2, 4), st.lists(st.integers(-1, 3), max_size=3),
                       st.sampled_from(["0", 1.0, True]))
SETTINGS = None


def fuzz(fn):
    return settings(SETTINGS)(fn)


@st.composite
def page_args(draw):
    n = draw(st.integers(0, 5))
    tp_shape = draw(st.sampled_from([(n, PAGE), (n, PAGE), (n, PAGE + 1), (n + 1, PAGE)]))
    return (draw(indices(tp_shape, KV_SLOTS)), draw(indices((n,), STAGING_SLOTS)))


def run_all(examples: int) -> None:
    global SETTINGS
    SETTINGS = settings(max_examples=examples, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))

    @fuzz
    @given(args=page_args(), backend=backends)
    def gather(args, backend):
        outcome("gather", lambda: kvmove.gather(KV, STAGING, *args, backend=backend))

    @fuzz
    @given(args=page_args(), backend=backends, layers=layers_arg)
    def scatter(args, backend, layers):
        tp, slots = args
        outcome("scatter", lambda: kvmove.scatter(STAGING, slots, KV, tp, layers=layers,
                                                  backend=backend))

    @fuzz
    @given(data=st.data(), backend=st.sampled_from(["torch", "triton"]))
    def unchecked(data, backend):
        """check=False: in-range rows copied, out-of-range rows skipped and counted exactly."""
        n = data.draw(st.integers(0, 6))
        src = torch.tensor(data.draw(st.lists(st.one_of(st.integers(-1, KV_SLOTS - 1), big),
                                              min_size=n, max_size=n)), dtype=torch.int64)
        dst = torch.tensor(data.draw(st.permutations(range(STAGING_SLOTS * PAGE)))[:n],
                           dtype=torch.int64)
        dst[data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=2))[:n]] = -5 if n else 0
        bad = int(((src < -1) | (src >= KV_SLOTS) | (dst < -1)).sum())
        errors = kvmove.copy_rows(KV, src, STAGING, dst, backend=backend, check=False)
        assert int(errors) == bad, (int(errors), bad)
        OUTCOMES["copy_rows check=False: counted"] += 1

    @fuzz
    @given(src=indices((5,), KV_SLOTS), dst=indices((5,), STAGING_SLOTS * PAGE),
           backend=backends, layers=layers_arg)
    def copy_rows(src, dst, backend, layers):
        outcome("copy_rows", lambda: kvmove.copy_rows(KV, src, STAGING, dst, layers=layers,
                                                      backend=backend))

    @fuzz
    @given(keys=keys_strategy, slots=indices((3,), STAGING_SLOTS),
           valid=st.one_of(st.none(), st.integers(-5, 10**12), st.lists(big, max_size=4),
                           st.sampled_from([2.5, "4", True, float("nan")])))
    def describe(keys, slots, valid):
        outcome("describe", lambda: kvmove.describe(STAGING, slots, keys, valid_tokens=valid))

    @fuzz
    @given(n=st.one_of(st.integers(-3, 10), big, st.sampled_from([1.5, "2", None, True])),
           free=indices((2,), STAGING_SLOTS))
    def slots(n, free):
        def alloc_then_free():
            got = STAGING.alloc(n)
            STAGING.free(got)

        outcome("StagingBuffer.alloc", alloc_then_free)
        outcome("StagingBuffer.free", lambda: STAGING.free(free))

    @fuzz
    @given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=4),
           dtype=st.sampled_from(INT_DTYPES + OTHER_DTYPES), stride=st.booleans(),
           name=st.one_of(st.text(max_size=4), st.integers()))
    def cache(shape, dtype, stride, name):
        def make():
            t = torch.zeros(shape, dtype=dtype)
            if stride and t.dim() >= 2:
                t = t.transpose(-1, -2)
            kv = kvmove.KVCache({name: t})
            kvmove.StagingBuffer(kv, num_slots=2, page_tokens=2)

        outcome("KVCache", make)

    for fn in (gather, scatter, unchecked, copy_rows, describe, slots, cache):
        fn()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=100)
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"
    run_all(args.examples)
    assert all(STAGING.num_free == STAGING_SLOTS for _ in [0]), "staging slots leaked"
    print(json.dumps({"examples_per_target": args.examples, "outcomes": dict(OUTCOMES)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
