"""SGLang's storage metrics from kvmove's backend (``--enable-storage-metrics``): pages per
prefetch and backup, and their bandwidth, bytes of the pages moved over the call's time,
as SGLang's ``StorageMetrics``; a prefetch counts only the pages it found."""

from __future__ import annotations

import time

import pytest

from tests.integrations.sglang.conftest import LAYERS, MLA_DIM, kvmove_backend, storage_config
from tests.integrations.sglang.test_interop import PAGE, indices, make_pool


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_prefetch_and_backup_pages_and_bandwidth(master, model, layout):
    config = storage_config(mla=True, page_first=layout == "page_first", model=model)
    config.enable_storage_metrics = True
    backend = kvmove_backend(config)
    try:
        backend.register_mem_pool_host(make_pool("mla", layout, 3))
        page_bytes = PAGE * LAYERS * MLA_DIM * 2  # bf16 rows
        t0 = time.perf_counter()
        assert backend.batch_set_v1(["a", "b", "c"], indices([1, 2, 3])) == [True] * 3
        set_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = backend.batch_get_v1(["a", "b", "c", "absent"], indices([8, 9, 10, 11]))
        get_s = time.perf_counter() - t0
        assert got == [True, True, True, False]
        stats = backend.get_stats()
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        # bytes over the call's own time: no less than over the test's wider window
        for [bw], secs in ((stats.backup_bandwidth, set_s), (stats.prefetch_bandwidth, get_s)):
            assert 3 * page_bytes / 2**30 / secs <= bw < 3 * page_bytes / 2**30 / 1e-6
        again = backend.get_stats()  # taken: the next interval starts empty
        assert again.prefetch_pgs == again.backup_pgs == again.prefetch_bandwidth == []
    finally:
        backend.close()


def test_nothing_is_kept_without_storage_metrics(master, model):
    backend = kvmove_backend(storage_config(mla=True, page_first=True, model=model))
    try:
        backend.register_mem_pool_host(make_pool("mla", "page_first", 4))
        assert backend.batch_set_v1(["x"], indices([1])) == [True]
        assert backend.batch_get_v1(["x"], indices([5])) == [True]
        stats = backend.get_stats()
        assert stats.prefetch_pgs == stats.backup_pgs == []
    finally:
        backend.close()
