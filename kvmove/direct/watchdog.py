"""``Watchdog``: gives up on a transport call that has not returned in time.

Mooncake bounds most writes itself (``MC_TRANSFER_TIMEOUT``, 5 s here), but not the first
contact with a peer that stopped answering: that handshake waits 60 s, holding the
engine. One thread per sender watches every call in flight and, past ``timeout`` seconds,
tells its link to give up (``link.abandon(token)``); the call itself still runs to its
end on its own thread."""

from __future__ import annotations

import threading
import time


class Watchdog:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self._armed: dict[object, tuple[float, object]] = {}  # token -> (deadline, link)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def arm(self, link, token: object) -> None:
        """Watch the call ``token`` of ``link`` from now on."""
        with self._cond:
            wake = not self._armed
            self._armed[token] = (time.monotonic() + self.timeout, link)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvmove-watchdog",
                                                daemon=True)
                self._thread.start()
            if wake:
                self._cond.notify()

    def disarm(self, token: object) -> None:
        """The call ``token`` returned."""
        with self._cond:
            self._armed.pop(token, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                late = [(t, link) for t, (deadline, link) in self._armed.items()
                        if deadline <= now]
                for token, _ in late:
                    del self._armed[token]
                if not late:
                    first = min((d for d, _ in self._armed.values()), default=None)
                    self._cond.wait(None if first is None else first - now)
                    continue
            for token, link in late:
                link.abandon(token)
