"""Running a test's worker in several threads at once."""

from __future__ import annotations

import threading
from collections import Counter


def run_threads(worker, count: int, timeout: float = 300.0) -> None:
    """Start ``worker(i)`` for ``i`` in ``0..count-1``, each in its own thread, and wait for
    every one (a thread still running after ``timeout`` seconds fails the test)."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish"


def close_while_calling(call, close, *, count: int = 4, settle: float = 0.3) -> Counter:
    """Run ``call(w, i)`` over and over in ``count`` threads (``w`` the thread, ``i`` its
    call number; it returns an outcome label) and call ``close()`` after ``settle`` seconds,
    while they run. A thread stops at its first ``KVMoveError`` (counted ``"refused"``); any
    other exception fails the test. Returns the outcomes counted."""
    from kvmove import KVMoveError

    outcomes: Counter = Counter()
    unexpected: list[BaseException] = []
    stop = threading.Event()

    def caller(w: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                outcomes[call(w, i)] += 1
            except KVMoveError:
                outcomes["refused"] += 1
                return
            except BaseException as e:  # anything else is a bug
                unexpected.append(e)
                return
            i += 1

    threads = [threading.Thread(target=caller, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    try:
        stop.wait(settle)
        close()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert unexpected == [], unexpected
    assert not any(t.is_alive() for t in threads), "a caller thread did not finish"
    return outcomes
