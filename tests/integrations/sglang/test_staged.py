"""The staged path of MLA ``layer_first`` pools (:mod:`kvmove.integrations.sglang.staged`):
the objects are SGLang's own, byte for byte, in both directions; statuses are those of the
in-place path (a miss, an object of another size, a page that exists); ``auto`` says what it
chose and keeps it; the settings are read as documented."""

from __future__ import annotations

import threading

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

import kvmove
from kvmove.integrations.sglang.staged import (
    DEFAULT_STAGING_BYTES,
    STAGED_MIN_GAIN,
    page_rows,
    prefer_in_place,
    settings,
)
from kvmove.mover.path_choice import PathChoice, decide, forget_recorded
from tests.integrations.sglang.conftest import (
    LAYERS,
    MLA_DIM,
    kvmove_backend,
    mla_pool,
    page_data,
    sglang_backend,
    storage_config,
)

TOKENS = 64


@pytest.fixture(autouse=True)
def _no_path_settings_from_the_environment(monkeypatch):
    """The settings these tests name come from extra_config alone."""
    monkeypatch.delenv("KVMOVE_SGLANG_PATH", raising=False)
    monkeypatch.delenv("KVMOVE_SGLANG_STAGING_BYTES", raising=False)


def indices(pages, page):
    return torch.tensor([p * page + t for p in pages for t in range(page)], dtype=torch.int64)


def config(model, path=None, **extra):
    if path is not None:
        extra["kvmove_path"] = path
    return storage_config(mla=True, page_first=False, model=model, extra=extra)


@pytest.mark.parametrize("page", [1, 4, 64])
@pytest.mark.parametrize("direction", ["sglang->kvmove", "kvmove->sglang", "kvmove->kvmove"])
def test_staged_objects_are_sglangs_rows_exact(page, direction, master, model):
    tokens = max(TOKENS, 12 * page)
    make = {"sglang": lambda: sglang_backend(config(model)),
            "kvmove": lambda: kvmove_backend(config(model, "staged"))}
    writer_kind, reader_kind = direction.split("->")
    writer, reader = make[writer_kind](), make[reader_kind]()
    try:
        src = mla_pool("layer_first", page_size=page, tokens=tokens, seed=1)
        dst = mla_pool("layer_first", page_size=page, tokens=tokens, seed=2)
        before = {p: page_data(dst, p) for p in range(tokens // page)}
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        for backend in (writer, reader):
            staged = getattr(backend, "staged", None)
            assert staged is None or (staged.choice.evict, staged.choice.prefetch) == (
                "staged", "staged")
        keys = ["s7", "s2", "s9", "s4"]
        put_pages, get_pages = [7, 2, 9, 4], [3, 11, 0, 5]  # scattered, out of order
        assert writer.batch_set_v1(keys, indices(put_pages, page)) == [True] * 4
        assert reader.batch_exists([*keys, "none"]) == 4
        assert reader.batch_get_v1(keys, indices(get_pages, page)) == [True] * 4
        for d, s in zip(get_pages, put_pages, strict=True):
            assert page_data(dst, d) == page_data(src, s)
        for p in set(range(tokens // page)) - set(get_pages):
            assert page_data(dst, p) == before[p]
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(("path", "spans"), [("staged", 1), ("in_place", LAYERS)])
def test_a_staged_object_is_one_span(path, spans, master, model, monkeypatch):
    """What the staged path is for: the store moves one span per object (in place, one per
    layer), for puts and gets alike."""
    from kvmove.store.mooncake_store import MooncakeStore

    seen = []
    for name in ("_put_chunk", "_get_chunk"):
        original = getattr(MooncakeStore, name)

        def spy(self, client, part, *args, original=original, **kwargs):
            seen.append({len(p) for p in part.ptrs})
            return original(self, client, part, *args, **kwargs)

        monkeypatch.setattr(MooncakeStore, name, spy)
    backend = kvmove_backend(config(model, path))
    try:
        backend.register_mem_pool_host(mla_pool("layer_first", page_size=2, tokens=TOKENS,
                                                seed=4))
        seen.clear()  # (an auto probe would have put and got too)
        assert backend.batch_set_v1(["o1", "o2"], indices([1, 2], 2)) == [True, True]
        assert backend.batch_get_v1(["o1", "o2"], indices([5, 6], 2)) == [True, True]
        assert seen == [{spans}, {spans}]
    finally:
        backend.close()


def test_statuses_as_in_place_a_miss_a_wrong_size_and_a_page_that_exists(master, model):
    backend = kvmove_backend(config(model, "staged"))
    small = sglang_backend(config(model))  # pages of 2 tokens: objects of another size
    try:
        pool = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=1)
        backend.register_mem_pool_host(pool)
        small.register_mem_pool_host(mla_pool("layer_first", page_size=2, tokens=TOKENS,
                                              seed=3))
        assert small.batch_set_v1(["two"], torch.arange(2, 4)) == [True]
        first = page_data(pool, 1)
        assert backend.batch_set_v1(["a", "c"], indices([1, 2], 4)) == [True, True]
        pool.kv_buffer[:, 4:8] = 0  # page 1 changes; its stored object must not
        assert backend.batch_set_v1(["a"], indices([1], 4)) == [True]  # it exists: kept
        before = {p: page_data(pool, p) for p in (10, 11, 12, 13)}
        got = backend.batch_get_v1(["a", "b", "two", "c"], indices([10, 11, 12, 13], 4))
        assert got == [True, False, False, True]
        assert page_data(pool, 10) == first
        assert page_data(pool, 11) == before[11] and page_data(pool, 12) == before[12]
        assert page_data(pool, 13) == page_data(pool, 2)
    finally:
        backend.close()
        small.close()


def test_v2_moves_the_kv_pages_staged(master, model):
    writer = kvmove_backend(config(model, "staged"))
    reader = sglang_backend(config(model))
    try:
        src = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=1)
        dst = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=2)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        put = writer.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=["v1", "v2"],
                                                host_indices=indices([3, 5], 4))])
        assert put == {PoolName.KV: [True, True]}
        got = writer.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=["v2", "v3"],
                                                host_indices=indices([8, 9], 4))])
        assert got == {PoolName.KV: [True, False]}
        assert page_data(src, 8) == page_data(src, 5)
        assert reader.batch_get_v1(["v1"], indices([0], 4)) == [True]
        assert page_data(dst, 0) == page_data(src, 3)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("put", [True, False])
def test_a_v2_call_checks_every_transfer_before_anything_moves(put, master, model):
    backend = kvmove_backend(config(model, "staged"))
    try:
        pool = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=1)
        backend.register_mem_pool_host(pool)
        if not put:
            assert backend.batch_set_v1(["q1"], indices([1], 4)) == [True]
        before = page_data(pool, 6)
        kv = PoolTransfer(name=PoolName.KV, keys=["q1"], host_indices=indices([1 if put else 6],
                                                                              4))
        unknown = PoolTransfer(name=PoolName.INDEXER, keys=["q1"], host_indices=indices([2], 4))
        call = backend.batch_set_v2 if put else backend.batch_get_v2
        with pytest.raises(ValueError, match="not registered"):
            call([kv, unknown])
        if put:
            assert backend.batch_exists(["q1"]) == 0  # nothing was stored
        assert page_data(pool, 6) == before  # nothing was read into the pool
    finally:
        backend.close()


def test_two_kv_transfers_in_one_v2_call_both_move(master, model):
    backend = kvmove_backend(config(model, "staged"))
    try:
        pool = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=1)
        backend.register_mem_pool_host(pool)
        first = PoolTransfer(name=PoolName.KV, keys=["t1", "t2"], host_indices=indices([1, 2], 4))
        second = PoolTransfer(name=PoolName.KV, keys=["t3"], host_indices=indices([3], 4))
        backend.batch_set_v2([first, second])
        assert backend.batch_exists(["t1", "t2", "t3"]) == 3
        assert backend.batch_get_v1(["t1", "t3"], indices([8, 9], 4)) == [True, True]
        assert page_data(pool, 8) == page_data(pool, 1)
        assert page_data(pool, 9) == page_data(pool, 3)
    finally:
        backend.close()


def test_a_call_larger_than_the_staging_runs_in_pieces(master, model):
    object_bytes = LAYERS * 1 * MLA_DIM * 2
    backend = kvmove_backend(config(model, "staged", kvmove_staging_bytes=3 * object_bytes))
    try:
        pool = mla_pool("layer_first", page_size=1, tokens=TOKENS, seed=5)
        backend.register_mem_pool_host(pool)
        assert backend.staged.mover.staging.num_slots == 3
        keys = [f"k{i}" for i in range(10)]
        assert backend.batch_set_v1(keys, indices(range(10), 1)) == [True] * 10
        assert backend.batch_get_v1(keys, indices(range(20, 30), 1)) == [True] * 10
        for i in range(10):
            assert page_data(pool, 20 + i) == page_data(pool, i)
    finally:
        backend.close()


def test_repeated_keys_or_pages_move_in_place(master, model):
    """A mover refuses a key or a page named twice; such a call moves as the in-place path
    (SGLang's own backend) moves it, not with an error."""
    backend = kvmove_backend(config(model, "staged"))
    try:
        pool = mla_pool("layer_first", page_size=1, tokens=TOKENS, seed=6)
        backend.register_mem_pool_host(pool)
        assert backend.batch_set_v1(["x", "x"], indices([1, 2], 1)) == [True, True]
        assert backend.batch_get_v1(["x", "y"], indices([9, 9], 1)) == [True, False]
        assert page_data(pool, 9) == page_data(pool, 1)
    finally:
        backend.close()


def test_sglangs_io_threads_may_set_and_get_at_once(master, model):
    backend = kvmove_backend(config(model, "staged"))
    try:
        pool = mla_pool("layer_first", page_size=1, tokens=128, seed=7)
        backend.register_mem_pool_host(pool)
        assert backend.batch_set_v1([f"r{i}" for i in range(16)],
                                    indices(range(16), 1)) == [True] * 16
        results, errors = {}, []

        def run(name, fn):
            try:
                results[name] = [fn(i) for i in range(6)]
            except Exception as e:  # reported below
                errors.append(e)

        def put(i):
            return backend.batch_set_v1([f"w{i}-{j}" for j in range(8)],
                                        indices(range(16 + 8 * i, 24 + 8 * i), 1))

        def get(i):
            return backend.batch_get_v1([f"r{j}" for j in range(16)],
                                        indices(range(80 + (i % 2) * 16, 96 + (i % 2) * 16),
                                                1))

        threads = [threading.Thread(target=run, args=a) for a in (("put", put), ("get", get))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert results["put"] == [[True] * 8] * 6 and results["get"] == [[True] * 16] * 6
        for i in range(16):
            assert page_data(pool, 80 + i) == page_data(pool, i) == page_data(pool, 96 + i)
    finally:
        backend.close()


def test_staging_that_stays_full_fails_the_pages_never_raises(master, model):
    backend = kvmove_backend(config(model, "staged", kvmove_staging_bytes=1))
    try:
        pool = mla_pool("layer_first", page_size=1, tokens=TOKENS, seed=9)
        backend.register_mem_pool_host(pool)
        mover = backend.staged.mover
        mover.alloc_timeout = 0.2
        held = mover.staging.alloc(mover.staging.num_slots)  # as store calls given up hold them
        try:
            assert backend.batch_set_v1(["f1", "f2"], indices([1, 2], 1)) == [False, False]
            assert backend.batch_get_v1(["f1"], indices([3], 1)) == [False]
        finally:
            mover.staging.free(held)
        assert backend.batch_set_v1(["f1"], indices([1], 1)) == [True]
    finally:
        backend.close()


def test_registering_again_lets_the_first_staging_go(master, model):
    backend = kvmove_backend(config(model, "staged"))
    try:
        backend.register_mem_pool_host(mla_pool("layer_first", page_size=1, tokens=TOKENS,
                                                seed=1))
        first = backend.staged
        pool = mla_pool("layer_first", page_size=1, tokens=TOKENS, seed=2)
        backend.register_mem_pool_host(pool)
        with pytest.raises(kvmove.KVMoveError, match="closed"):
            first.mover.evict(["late"], torch.tensor([[0]]))
        assert backend.batch_set_v1(["n"], indices([5], 1)) == [True]
        assert backend.batch_get_v1(["n"], indices([6], 1)) == [True]
        assert page_data(pool, 6) == page_data(pool, 5)  # the new pool's pages
    finally:
        backend.close()


def test_a_probe_that_fails_leaves_the_pages_in_place(master, model, monkeypatch):
    import kvmove.integrations.sglang.staged as staged

    def failing(*args, **kwargs):
        raise RuntimeError("no room for scratch pages")

    forget_recorded()
    monkeypatch.setattr(staged, "probe", failing)
    backend = kvmove_backend(config(model))
    try:
        backend.register_mem_pool_host(mla_pool("layer_first", page_size=1, tokens=TOKENS,
                                                seed=1))
        choice = backend.staged.choice
        assert (choice.evict, choice.prefetch) == ("in_place", "in_place")
        assert "probe failed" in choice.reason and backend.staged.mover is None
        assert backend.batch_set_v1(["i"], indices([1], 1)) == [True]
    finally:
        backend.close()
        forget_recorded()


def test_a_near_tie_stays_in_place_with_no_staging(master, model, monkeypatch):
    import kvmove.integrations.sglang.staged as staged

    def near_tie(*args, **kwargs):  # what a probe of 16-token pages measured
        return {"staged": {"evict": 31.3, "prefetch": 26.2},
                "in_place": {"evict": 28.7, "prefetch": 27.0}, "pages": 32, "rounds": 3}

    forget_recorded()
    monkeypatch.setattr(staged, "probe", near_tie)
    backends = [kvmove_backend(config(model)) for _ in range(2)]
    try:
        for seed, backend in enumerate(backends):
            backend.register_mem_pool_host(mla_pool("layer_first", page_size=1, tokens=TOKENS,
                                                    seed=seed))
            choice = backend.staged.choice
            assert (choice.evict, choice.prefetch) == ("in_place", "in_place")
            assert backend.staged.mover is None  # no staging memory for a path not taken
            assert "staged only where 20% faster" in choice.reason
        assert backends[1].staged.choice.recorded  # the raw figures, the same rule again
    finally:
        for backend in backends:
            backend.close()
        forget_recorded()


def test_auto_says_what_it_chose_and_keeps_it(master, model):
    forget_recorded()  # (no choice of an earlier test)
    first = kvmove_backend(config(model))
    second = kvmove_backend(config(model))
    try:
        first.register_mem_pool_host(mla_pool("layer_first", page_size=1, tokens=TOKENS,
                                              seed=1))
        second.register_mem_pool_host(mla_pool("layer_first", page_size=1, tokens=TOKENS,
                                               seed=2))
        a, b = first.staged.choice, second.staged.choice
        assert a.reason.startswith("auto")
        assert (b.evict, b.prefetch) == (a.evict, a.prefetch)
        assert not a.recorded and b.recorded  # the same geometry and store: no second probe
        assert (first.staged.mover is None) == ("staged" not in (a.evict, a.prefetch))
        assert first.batch_set_v1(["k"], indices([3], 1)) == [True]
        assert second.batch_get_v1(["k"], indices([4], 1)) == [True]
    finally:
        first.close()
        second.close()


def test_page_first_pools_have_no_staged_path(master, model):
    backend = kvmove_backend(storage_config(mla=True, page_first=True, model=model,
                                            extra={"kvmove_path": "staged"}))
    try:
        backend.register_mem_pool_host(mla_pool("page_first", page_size=4, tokens=TOKENS,
                                                seed=1))
        assert backend.staged is None
    finally:
        backend.close()


def test_page_rows_leave_out_a_trailing_part_page():
    buffer = torch.arange(LAYERS * 70 * MLA_DIM, dtype=torch.int32).to(torch.bfloat16) \
        .view(LAYERS, 70, 1, MLA_DIM)
    cache = page_rows(buffer, 4)
    assert cache.num_slots == 17
    assert cache.layer("kv", 2)[16].numpy().tobytes() == \
        buffer[2, 64:68].contiguous().view(torch.uint8).numpy().tobytes()


def test_page_rows_are_the_pools_pages():
    pool = mla_pool("layer_first", page_size=4, tokens=TOKENS, seed=8)
    cache = page_rows(pool.kv_buffer, 4)
    assert cache.num_slots == pool.kv_buffer.shape[1] // 4 and cache.num_layers("kv") == LAYERS
    for layer in (0, LAYERS - 1):
        row = cache.layer("kv", layer)[5].numpy().tobytes()
        assert row == pool.kv_buffer[layer, 20:24].contiguous().view(torch.uint8).numpy() \
            .tobytes()


@pytest.mark.parametrize(("extra", "env", "expected"), [
    ({}, {}, ("auto", DEFAULT_STAGING_BYTES)),
    ({"kvmove_path": "staged"}, {"KVMOVE_SGLANG_PATH": "in_place"}, ("staged",
                                                                    DEFAULT_STAGING_BYTES)),
    ({}, {"KVMOVE_SGLANG_PATH": "in_place", "KVMOVE_SGLANG_STAGING_BYTES": "64mb"},
     ("in_place", 64 << 20)),
    ({"kvmove_staging_bytes": 1 << 20}, {}, ("auto", 1 << 20)),
])
def test_settings(extra, env, expected):
    assert settings(extra, env) == expected


@pytest.mark.parametrize(("extra", "env", "named"), [
    ({"kvmove_path": "fast"}, {}, "extra_config 'kvmove_path'"),
    ({}, {"KVMOVE_SGLANG_PATH": "fast"}, "KVMOVE_SGLANG_PATH"),
    ({"kvmove_staging_bytes": "lots"}, {}, "kvmove_staging_bytes"),
    ({}, {"KVMOVE_SGLANG_STAGING_BYTES": "0"}, "KVMOVE_SGLANG_STAGING_BYTES"),
])
def test_bad_settings_name_where_they_came_from(extra, env, named):
    with pytest.raises(ValueError, match=named):
        settings(extra, env)


@pytest.mark.parametrize(("staged_ms", "in_place_ms", "expected"), [
    ((5.8, 1.9), (21.9, 19.2), ("staged", "staged")),  # one-token pages, measured
    ((31.3, 26.2), (28.7, 27.0), ("in_place", "in_place")),  # 16-token pages: a near tie
    ((1.0, 0.81), (1.0, 1.0), ("in_place", "in_place")),  # 19 % faster: not enough
    ((0.79, 2.0), (1.0, 1.0), ("staged", "in_place")),
])
def test_auto_stages_a_direction_only_where_clearly_faster(staged_ms, in_place_ms, expected):
    assert STAGED_MIN_GAIN == 0.2
    figures = {"staged": dict(zip(("evict", "prefetch"), staged_ms, strict=True)),
               "in_place": dict(zip(("evict", "prefetch"), in_place_ms, strict=True)),
               "pages": 32, "rounds": 3}
    choice = prefer_in_place(decide(figures))
    assert (choice.evict, choice.prefetch) == expected
    assert choice.figures == figures
    unsafe = PathChoice("staged", "staged", "auto: unsafe", {"unsafe": "a get wrote"})
    assert prefer_in_place(unsafe) is unsafe
