"""Running a test's worker in several threads at once."""

from __future__ import annotations

import threading


def run_threads(worker, count: int, timeout: float = 300.0) -> None:
    """Start ``worker(i)`` for ``i`` in ``0..count-1``, each in its own thread, and wait for
    every one (a thread still running after ``timeout`` seconds fails the test)."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish"
