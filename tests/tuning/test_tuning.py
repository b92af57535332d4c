"""The tuning cache and its lookup order (trial tables, user cache, defaults), tuning on
first use, the recorded direct/two-hop choice behind ``backend="auto"``, the search, and
``kvmove tune`` on a machine without a GPU. No GPU needed: the timings are faked."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvmove.cli import tune as command
from kvmove.kernels import configs
from kvmove.kernels.configs import LaunchConfig
from kvmove.rows import launch_config
from kvmove.rows.prepared import resolve_backend
from kvmove.tuning import autotune, config_search, key_tuning

GPU = "Fake GPU 9000"
USER = LaunchConfig(block_bytes=512, rows=4, num_warps=2, max_programs=8)
TRIAL = LaunchConfig(block_bytes=128, rows=2, num_warps=1, max_programs=4)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private user cache; registrations forgotten around each test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(autotune.ENV_AUTOTUNE, raising=False)
    launch_config.reset()
    yield tmp_path
    launch_config.reset()


def write_json(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def table(entries: dict[str, LaunchConfig], paths: dict[str, str] | None = None) -> dict:
    return {"configs": {k: c.to_dict() for k, c in entries.items()}, "paths": paths or {}}


def test_lookup_order_is_trial_tables_then_user_cache_then_defaults():
    a, b = "gather/small/p64", "gather/tiny/p1"
    write_json(launch_config.cache_path(GPU), table({a: USER, b: USER}))
    # Before the first launch on this GPU the user cache is not consulted.
    assert launch_config.pick("gather", 656, 64, GPU) == configs.default_config(656)
    launch_config.user_table(GPU)  # what the first lookup on a GPU does
    assert launch_config.pick("gather", 656, 64, GPU) == USER  # user cache
    assert launch_config.pick("scatter", 4096, 16, GPU) == configs.default_config(4096)
    # A trial table (the tuner's) goes in front of the user cache until it is removed.
    trial = configs.TunedTable(configs={b: TRIAL})
    launch_config.register_table(trial, GPU)
    assert launch_config.pick("gather", 132, 1, GPU) == TRIAL
    assert launch_config.pick("gather", 656, 64, GPU) == USER
    launch_config.unregister_table(trial)
    assert launch_config.pick("gather", 132, 1, GPU) == USER
    # Another GPU sees neither this GPU's user cache nor its trials.
    assert launch_config.pick("gather", 656, 64, "Other GPU") == configs.default_config(656)
    # The interpreter keeps its fixed config.
    assert launch_config.pick("gather", 656, 64, None) == configs.INTERPRETER_CONFIG


def test_cache_file_is_keyed_by_gpu_and_triton_version(tmp_path):
    path = launch_config.cache_path("NVIDIA H200", "3.9.0")
    assert path == tmp_path / "cache" / "kvmove" / "tuned" / "nvidia-h200-triton3.9.0.json"
    version = launch_config.triton_version()
    assert launch_config.cache_path("NVIDIA H200").name.endswith(f"-triton{version}.json")


def fake_result(key="gather/small/p64", config=USER, direct=10.0, two_hop=20.0):
    direction, _, _ = key.split("/")
    return key_tuning.KeyResult(key=key, direction=direction, row_bytes=656, page_tokens=64,
                            layers=8, nbytes=1 << 20, config=config, config_gbps=12.0,
                            default_gbps=10.0, evaluated=5, direct_gbps=direct,
                            two_hop_gbps=two_hop)


def test_autotune_on_first_use_tunes_a_missing_key_once_and_caches_it(monkeypatch):
    calls = []

    def fake_tune(device, direction, row_bytes, page_tokens, *, quick):
        calls.append((direction, row_bytes, page_tokens, quick))
        return fake_result()

    monkeypatch.setattr(autotune, "tune_key", fake_tune)
    autotune.tune_missing(GPU, torch.device("cpu"), [("gather", 656, 64)])
    assert calls == []  # off by default
    monkeypatch.setenv(autotune.ENV_AUTOTUNE, "1")
    for _ in range(3):
        # the same key, another shape
        autotune.tune_missing(GPU, torch.device("cpu"), [("gather", 700, 50)])
    assert calls == [("gather", 700, 50, True)]
    assert launch_config.pick("gather", 656, 64, GPU) == USER
    assert launch_config.pick_path("gather", 656, 64, GPU) == "two_hop"
    saved = json.loads(launch_config.cache_path(GPU).read_text())
    assert saved["configs"]["gather/small/p64"] == USER.to_dict()
    assert saved["paths"]["gather/small/p64"] == "two_hop"
    assert saved["gpu"] == GPU and saved["triton"] == launch_config.triton_version()
    # A fresh process reads it back from the cache without tuning again.
    launch_config.reset()
    autotune.tune_missing(GPU, torch.device("cpu"), [("gather", 656, 64)])
    assert len(calls) == 1 and launch_config.pick("gather", 656, 64, GPU) == USER


def test_a_failed_autotune_never_breaks_the_copy(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(autotune, "tune_key", broken)
    monkeypatch.setenv(autotune.ENV_AUTOTUNE, "1")
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        autotune.tune_missing(GPU, torch.device("cpu"), [("scatter", 132, 1)])
        autotune.tune_missing(GPU, torch.device("cpu"), [("scatter", 132, 1)])
    failures = [r for r in caplog.records if r.message.startswith("autotuning")]
    assert len(failures) == 1  # not retried at every launch
    assert launch_config.pick("scatter", 132, 1, GPU) == configs.default_config(132)


def test_auto_backend_follows_the_recorded_path(monkeypatch):
    """What the GPU test of ``backend="auto"`` taking the recorded two-hop path rests on
    (a test that spies on a name the copy path does not look up can never fail)."""
    from kvmove.memory import cuda_api

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU)
    monkeypatch.setattr(cuda_api, "copy_engine_problem", lambda: None)
    write_json(launch_config.cache_path(GPU),
               table({}, {"gather/small/p64": "two_hop", "scatter/small/p64": "direct"}))
    cuda = torch.device("cuda", 0)
    assert launch_config.preferred_backend(cuda, "gather", 656, 64) == "two_hop"
    assert launch_config.preferred_backend(cuda, "scatter", 656, 64) == "triton"
    assert launch_config.preferred_backend(cuda, "gather", 132, 1) == "triton"  # never measured
    assert resolve_backend("auto", cuda, direction="gather", row_bytes=700,
                           page_tokens=64) == "two_hop"
    assert resolve_backend("auto", cuda) == "triton"
    assert resolve_backend("triton", cuda, direction="gather", row_bytes=656,
                           page_tokens=64) == "triton"  # a forced backend stays forced


def test_auto_keeps_to_the_direct_kernel_where_the_copy_engine_cannot_run(monkeypatch,
                                                                         caplog):
    """A tuned table may prefer the two-hop path, but without the copy engine's binding
    (cuda-bindings) ``auto`` must not pick a path that fails at its first copy while
    serving: it keeps to the direct kernel and says why, once."""
    from kvmove.memory import cuda_api

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: GPU)
    monkeypatch.setattr(cuda_api, "copy_engine_problem",
                        lambda: "the copy engine needs cuda-bindings for CUDA 13")
    write_json(launch_config.cache_path(GPU), table({}, {"gather/small/p64": "two_hop"}))
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert resolve_backend("auto", cuda, direction="gather", row_bytes=656,
                                   page_tokens=64) == "triton"
    said = [r for r in caplog.records if "cuda-bindings" in r.getMessage()]
    assert len(said) == 1 and "direct kernel" in said[0].getMessage()


def test_unreadable_cache_is_ignored_with_a_warning(caplog):
    path = launch_config.cache_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        launch_config.user_table(GPU)
    assert "unreadable" in caplog.text
    assert launch_config.pick("gather", 656, 64, GPU) == configs.default_config(656)


def test_malformed_cache_entries_are_ignored_with_a_warning(caplog):
    write_json(launch_config.cache_path(GPU), {"configs": {"gather/small/p64": {"warps": 4}}})
    with caplog.at_level(logging.WARNING, logger="kvmove"):
        launch_config.user_table(GPU)
    assert "malformed" in caplog.text
    assert launch_config.pick("gather", 656, 64, GPU) == configs.default_config(656)


def test_results_merge_into_the_cache_file(tmp_path):
    path = tmp_path / "out" / "t.json"
    key_tuning.write_results(path, GPU, [fake_result("gather/small/p64")])
    key_tuning.write_results(path, GPU, [fake_result("scatter/tiny/p1", TRIAL, 30.0, 20.0)])
    data = json.loads(path.read_text())
    assert set(data["configs"]) == {"gather/small/p64", "scatter/tiny/p1"}
    assert data["paths"] == {"gather/small/p64": "two_hop", "scatter/tiny/p1": "direct"}
    assert data["measurements"]["scatter/tiny/p1"]["direct_gbps"] == 30.0
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]  # no temporary left behind
    parsed = configs.TunedTable.from_json(data)  # what the lookup reads
    assert parsed.configs["scatter/tiny/p1"] == TRIAL


def test_search_walks_to_the_fastest_valid_config():
    best_known = LaunchConfig(block_bytes=512, rows=8, num_warps=2, max_programs=8)

    def cost(c: LaunchConfig) -> float:
        return (1.0 + abs(c.block_bytes.bit_length() - 10) + abs(c.rows.bit_length() - 4)
                + abs(c.num_warps.bit_length() - 2) + abs(c.max_programs.bit_length() - 4))

    best, seen = config_search.search(cost, 656, max_programs=16)
    assert best == best_known
    assert all(config_search.valid(c, 656, 16) for c in seen)
    assert all(c.max_programs <= 16 and c.block_bytes <= 1024 for c in seen)


def test_valid_configs():
    ok = LaunchConfig(block_bytes=256, rows=8, num_warps=4, max_programs=16)
    assert config_search.valid(ok, 132, 16)
    assert not config_search.valid(LaunchConfig(512, 8, 4, 16), 132, 16)  # wider than the row
    assert not config_search.valid(LaunchConfig(256, 8, 4, 32), 132, 16)  # over the programs cap
    assert not config_search.valid(LaunchConfig(8192, 64, 4, 16), 8192, 16)  # tile too large
    # the narrowest block for tiny rows
    assert config_search.valid(LaunchConfig(128, 1, 1, 4), 4, 16)
    assert config_search.start_config(656, 8).max_programs == 8


def test_tune_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert command.tune_main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert command.tune_main(["--quick", "--row-bytes", "656"]) == 0
    assert not launch_config.cache_dir().exists()  # nothing written


def test_quick_search_tries_fewer_values():
    seen_quick = config_search.search(lambda c: 1.0 + c.rows + c.num_warps, 656, max_programs=16,
                               quick=True)[1]
    seen_full = config_search.search(lambda c: 1.0 + c.rows + c.num_warps, 656, max_programs=16)[1]
    assert {c.rows for c in seen_quick} <= set(config_search.QUICK_AXES["rows"]) | {
        config_search.start_config(656, 16).rows}
    assert {c.num_warps for c in seen_quick} <= set(config_search.QUICK_AXES["num_warps"]) | {
        config_search.start_config(656, 16).num_warps}
    assert len(seen_quick) < len(seen_full)
