"""Store nodes failing while kvmove's SGLang backend serves (SGLang's own host pools, storage
config and backend factory, as the interop tests use them), on a cluster of its own: a
master and two store-only processes that hold every object (the backends give no memory).

- ``KVMOVE_REPLICAS=2``: a node SIGKILLed between SGLang's set and get: every page reads
  back exact in the first get after the kill (from the surviving replica);
- one replica: the pages on the killed node read as not stored, their host pages
  untouched, the others exact; SGLang recomputes the missing ones (here: the test writes
  the pages it would have computed) and every page is then right;
- a node stopped (SIGSTOP): the get answers the stalled pages as not stored once Mooncake
  has let go of the host pages (SGLang frees them when the call answers): no region of the
  host pool is in use any more when it answers (a staged get's staging may be, until
  Mooncake returns: it is not SGLang's memory).

Each runs with the pages moved in place and through staging
(:mod:`kvmove.integrations.sglang.staged`).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import kvmove
from tests.integrations.sglang.conftest import kvmove_backend, mla_pool, page_data, storage_config
from tests.support.holder import Holder
from tests.support.store_state import regions_in_use

PAGE = 4
TOKENS = 128  # 32 pages
PAGES = list(range(1, 13))
TARGET = list(range(16, 28))


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    """A master of this test's own, two holders; the backends made now join it with no
    segment of their own."""
    with kvmove.EmbeddedMaster() as master:
        monkeypatch.setenv("MOONCAKE_MASTER", master.address)
        monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
        monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
        monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "0")
        holders = [Holder(master.address, log_path=tmp_path / f"holder{i}.log")
                   for i in range(2)]
        try:
            yield holders
        finally:
            for h in holders:
                h.close()


@pytest.fixture(params=["in_place", "staged"])
def path(request):
    return request.param


def serve(model, path):
    """A writer and a reader backend (SGLang's MLA layer_first host pools), their pages moved
    along ``path``."""
    config = storage_config(mla=True, page_first=False, model=model,
                            extra={"kvmove_path": path})
    writer, reader = kvmove_backend(config), kvmove_backend(config)
    src = mla_pool("layer_first", page_size=PAGE, tokens=TOKENS, seed=11)
    dst = mla_pool("layer_first", page_size=PAGE, tokens=TOKENS, seed=12)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    for backend in (writer, reader):
        assert backend.staged.choice.evict == backend.staged.choice.prefetch == path
    keys = [f"page{p}" for p in PAGES]
    assert writer.batch_set_v1(keys, indices(PAGES)) == [True] * len(PAGES)
    return writer, reader, src, dst, keys


def holder_of(reader, key) -> set[str]:
    store_key = reader.keys.kv_objects([key])[0][0]
    return {r.endpoint for r in reader.store.replicas([store_key])[0]}


def test_a_killed_node_loses_no_page_with_two_replicas(cluster, model, path, monkeypatch):
    monkeypatch.setenv("KVMOVE_REPLICAS", "2")
    writer, reader, src, dst, keys = serve(model, path)
    try:
        assert all(len(holder_of(reader, k)) == 2 for k in keys)
        cluster[0].kill()
        got = reader.batch_get_v1(keys, indices(TARGET))
        assert got == [True] * len(keys)
        for s, d in zip(PAGES, TARGET, strict=True):
            assert page_data(dst, d) == page_data(src, s)
    finally:
        writer.close()
        reader.close()


def test_one_replica_misses_are_recomputed_never_wrong(cluster, model, path):
    writer, reader, src, dst, keys = serve(model, path)
    try:
        lost = {k for k in keys if holder_of(reader, k) & cluster[0].endpoints}
        assert 0 < len(lost) < len(keys), "both holders should hold some pages"
        before = {d: page_data(dst, d) for d in TARGET}
        cluster[0].kill()
        got = reader.batch_get_v1(keys, indices(TARGET))
        assert [not ok for ok in got] == [k in lost for k in keys]
        for ok, s, d in zip(got, PAGES, TARGET, strict=True):
            if ok:
                assert page_data(dst, d) == page_data(src, s)
            else:  # untouched, then recomputed by the engine (SGLang's own page copy)
                assert page_data(dst, d) == before[d]
                dst.set_from_flat_data_page(d * PAGE, src.get_data_page(s * PAGE))
        for s, d in zip(PAGES, TARGET, strict=True):
            assert page_data(dst, d) == page_data(src, s)
    finally:
        writer.close()
        reader.close()


def test_a_stalled_node_answers_once_mooncake_lets_go(cluster, model, path, monkeypatch):
    monkeypatch.setenv("KVMOVE_CALL_TIMEOUT", "2")
    writer, reader, src, dst, keys = serve(model, path)
    stalled = cluster[1]
    resume = threading.Timer(5.0, lambda: stalled.proc.send_signal(signal.SIGCONT))
    try:
        before = {d: page_data(dst, d) for d in TARGET}
        stalled.kill(signal.SIGSTOP)
        resume.start()  # Mooncake's call returns once the node runs again
        got = reader.batch_get_v1(keys, indices(TARGET))
        assert False in got  # the stalled pages (and their call's) read as not stored
        pool = {address for address, _ in reader.kv.regions()}
        assert not pool & set(regions_in_use(reader.store))  # Mooncake let go of the pool
        for ok, s, d in zip(got, PAGES, TARGET, strict=True):
            if ok:
                assert page_data(dst, d) == page_data(src, s)
            elif path == "staged":  # what a late transfer writes lands in staging only
                assert page_data(dst, d) == before[d]
        if path == "staged":  # and it does not land later either
            resume.join()
            deadline = time.monotonic() + 30
            while regions_in_use(reader.store) and time.monotonic() < deadline:
                time.sleep(0.05)  # the get given up returns (its staging is let go)
            assert not regions_in_use(reader.store)
            for ok, d in zip(got, TARGET, strict=True):
                if not ok:
                    assert page_data(dst, d) == before[d]
        # Usable once the node runs again (a staged get answers at its bound, before then;
        # in place the answer came after it): the same pages read back exact.
        resume.join()
        assert reader.batch_get_v1(keys, indices(TARGET)) == [True] * len(keys)
        for s, d in zip(PAGES, TARGET, strict=True):
            assert page_data(dst, d) == page_data(src, s)
    finally:
        resume.cancel()
        stalled.proc.send_signal(signal.SIGCONT)
        writer.close()
        reader.close()
