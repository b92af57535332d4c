"""Tuning on a GPU: a tuned key copies right and holds up when timed again; a mover built
with ``KVMOVE_AUTOTUNE=1`` fills the user cache (tuning happens when a mover is built,
never in a copy call: a test that calls ``kvmove.gather`` finds no
file); ``backend="auto"`` takes the two-hop path where the user cache records it, seen in
what the prepared copy chose and in the ring it used (the old test spied on a module
attribute the copy path did not look up)."""

from __future__ import annotations

import json
import statistics

import torch

import kvmove
from tests.gpu.common import CUDA, build, random_pages


def test_tune_key_finds_a_valid_config_that_copies_right_and_holds_up_when_retimed():
    from kvmove.kernels import configs
    from kvmove.rows import launch_config
    from kvmove.tuning.config_search import start_config, valid
    from kvmove.tuning.key_tuning import bench_seconds, tune_key
    from kvmove.tuning.workload import Workload

    r = tune_key(CUDA, "gather", 656, 64, quick=True, target_bytes=16 << 20)
    assert valid(r.config, 656, 16)
    assert r.path in ("direct", "two_hop")
    trial = configs.TunedTable(configs={r.key: r.config})
    launch_config.register_table(trial, torch.cuda.get_device_name())
    try:
        kv = build([("kv", 3, 656, torch.uint8, 0)], 1024)
        staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=64)
        pages, slots = random_pages(1024, 5, 64), torch.tensor([7, 0, 3, 2, 5])
        kvmove.gather(kv, staging, pages, slots, backend="triton")
        torch.cuda.synchronize()
        reference = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=64)
        kvmove.gather(kv, reference, pages, slots, backend="torch")
        assert torch.equal(staging.tensor("kv"), reference.tensor("kv"))
    finally:
        launch_config.unregister_table(trial)
    # Timed again, apart from the search and interleaved with the default, the winner is
    # not slower than the default (beyond noise): a search that keeps a worse config, or
    # times configs differently from how they run, fails here.
    work = Workload(CUDA, 656, 64, layers=r.layers, target_bytes=16 << 20)
    try:
        run = work.launcher("gather")
        default = start_config(656, configs.DEFAULT_MAX_PROGRAMS)
        won, base = [], []
        for _ in range(5):
            won.append(bench_seconds(lambda: run(r.config), quick=True))
            base.append(bench_seconds(lambda: run(default), quick=True))
    finally:
        work.close()
    ratio = statistics.median(base) / statistics.median(won)
    print(f"tuned {r.config} vs default {default}: {ratio:.2f}x (medians of 5 interleaved)")
    assert ratio > 0.8, f"the tuned config is {1 / ratio:.2f}x slower than the default"


def test_a_mover_built_with_autotune_fills_the_user_cache(monkeypatch, gpu_store):
    from kvmove.rows import launch_config

    monkeypatch.setenv("KVMOVE_AUTOTUNE", "1")
    kv = build([("kv", 2, 132, torch.uint8, 0)], 256)
    path = launch_config.cache_path(torch.cuda.get_device_name())
    assert not path.exists()
    with kvmove.KVMover(kv, gpu_store, page_tokens=1, staging_slots=4) as mover:
        data = json.loads(path.read_text())
        assert {"gather/tiny/p1", "scatter/tiny/p1"} <= set(data["configs"])
        t = mover.evict(["a", "b"], torch.tensor([[5], [6]]))
        assert t.wait(60) == [kvmove.Status.OK] * 2
        p = mover.prefetch(["a", "b"], torch.tensor([[7], [8]]))
        assert p.wait(60) == [kvmove.Status.OK] * 2
        p.scattered.synchronize()
    assert torch.equal(kv.layer("kv", 1)[7:9], kv.layer("kv", 1)[5:7])


def test_auto_uses_the_two_hop_path_where_recorded():
    from kvmove.rows import launch_config
    from kvmove.rows.copy_engine.device_ring import ring_for
    from kvmove.rows.prepared import prepared_copy

    path = launch_config.cache_path(torch.cuda.get_device_name())
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"configs": {}, "paths": {"gather/small/p16": "two_hop"}}))
    kv = build([("kv", 3, 656, torch.uint8, 0)], 256)
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    chosen = prepared_copy(kv.row_pool, staging.row_pool, direction="gather", page_tokens=16)
    assert chosen.backends == {"two_hop"}, "backend='auto' did not take the recorded path"
    ring = ring_for(kv.row_pool.buffers["kv"])
    assert ring._last_use is None
    token_pages = random_pages(256, 3, 16)
    kvmove.gather(kv, staging, token_pages, torch.tensor([2, 0, 1]))  # auto, host indices
    torch.cuda.synchronize()
    assert ring._last_use is not None, "the gather did not go through the ring"
    reference = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=16)
    kvmove.gather(kv, reference, token_pages, torch.tensor([2, 0, 1]), backend="torch")
    assert torch.equal(staging.tensor("kv")[:, :3], reference.tensor("kv")[:, :3])
