"""A prepared copy switches to its device around each run and back to the device the calling
thread had, whatever other threads do meanwhile. ``torch.cuda.device``
keeps the device it replaced on the guard object, so one guard shared by threads (the
prepared copy used to keep one) hands one thread the other's device. Watched on the CPU
with a stand-in guard that has torch's logic over a per-thread current device."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvmove
from kvmove.rows import prepared as prepared_module
from tests.support.fake_cuda import FakeDeviceGuard


def test_concurrent_runs_restore_each_threads_own_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", FakeDeviceGuard)
    monkeypatch.setattr(torch.cuda, "current_device", FakeDeviceGuard.current_device)
    monkeypatch.setattr(prepared_module, "kernel_device",
                        lambda src, dst: torch.device("cuda", 1))  # a copy "on" GPU 1
    real_copy = prepared_module.copy_rows_torch
    seen_inside = []

    def slow_copy(*args, **kwargs):
        seen_inside.append(FakeDeviceGuard.current.idx)
        time.sleep(0.002)  # both threads inside at once
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(prepared_module, "copy_rows_torch", slow_copy)
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 64, 132), dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=4)
    copy = prepared_module.PreparedCopy(kv.row_pool, staging.row_pool, None, backend="torch",
                                        direction="gather", page_tokens=4)
    assert copy.device == torch.device("cuda", 1)
    rows = torch.arange(8)
    start = threading.Barrier(2)
    wrong = []

    def engine_thread(own: int) -> None:
        FakeDeviceGuard.exchange(own)  # this thread's current device
        start.wait()
        for _ in range(20):
            copy.run(rows, rows, None)
            now = FakeDeviceGuard.current.idx
            if now != own:
                wrong.append((own, now))

    threads = [threading.Thread(target=engine_thread, args=(own,)) for own in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [], f"a thread got another's device back: {wrong[:3]}"
    assert set(seen_inside) == {1}  # every run ran on the copy's device
    expect = torch.stack([kv.layer("kv", layer)[:8] for layer in range(2)])
    assert torch.equal(staging.tensor("kv")[:, :2].reshape(2, 8, 132), expect)


@pytest.mark.parametrize("n", [0, 3])
def test_a_cpu_copy_takes_no_guard(monkeypatch, n):
    def no_guard(device):
        raise AssertionError("a CPU copy switched devices")

    monkeypatch.setattr(torch.cuda, "device", no_guard)
    kv = kvmove.KVCache({"kv": torch.zeros(2, 16, 4, dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=4, page_tokens=4)
    copy = prepared_module.prepared_copy(kv.row_pool, staging.row_pool, backend="torch",
                                         direction="gather", page_tokens=4)
    copy.run(torch.arange(n), torch.arange(n), None)


def test_a_copy_on_the_threads_current_device_takes_no_guard(monkeypatch):
    """The usual case, one GPU or the engine's own: no guard entered and left per call."""
    entered = []

    class CountingGuard(FakeDeviceGuard):
        def __enter__(self):
            entered.append(self.idx)
            return super().__enter__()

    monkeypatch.setattr(torch.cuda, "device", CountingGuard)
    monkeypatch.setattr(torch.cuda, "current_device", FakeDeviceGuard.current_device)
    monkeypatch.setattr(prepared_module, "kernel_device",
                        lambda src, dst: torch.device("cuda", 1))
    kv = kvmove.KVCache({"kv": torch.randint(0, 256, (2, 64, 132), dtype=torch.uint8)})
    staging = kvmove.StagingBuffer(kv, num_slots=8, page_tokens=4)
    copy = prepared_module.PreparedCopy(kv.row_pool, staging.row_pool, None, backend="torch",
                                        direction="gather", page_tokens=4)
    rows = torch.arange(8)
    FakeDeviceGuard.exchange(1)
    copy.run(rows, rows, None)
    assert entered == []
    FakeDeviceGuard.exchange(0)
    copy.run(rows, rows, None)
    assert entered == [1]
    assert FakeDeviceGuard.current_device() == 0
