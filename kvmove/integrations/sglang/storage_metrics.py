"""SGLang's storage metrics (``--enable-storage-metrics``): pages prefetched and backed up
per call and their bandwidth, as SGLang's own Mooncake backend reports them
(``StorageMetrics``: ``prefetch_pgs``, ``backup_pgs``, ``prefetch_bandwidth``,
``backup_bandwidth``, in SGLang's unit: GiB, 2**30 bytes, per second). Bandwidth is the
bytes of the pages moved (every object ``OK``) over the call's wall time. Unlike SGLang's
own backend, a backup of pages the store already holds counts them: kvmove's put sends
without an exists check, and Mooncake 0.3.13 answers 0 (OK) for a key it holds."""

from __future__ import annotations

import threading

import numpy as np

from kvmove.status import Status


class StorageFigures:
    """The calls' figures since SGLang last asked (:meth:`take`); records nothing unless
    ``enabled`` (SGLang's ``enable_storage_metrics``: nobody would take them)."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self._lock = threading.Lock()
        self._lists = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                       "backup_bandwidth": []}

    def moved(self, statuses: list[Status], n: int, view, seconds: float, *,
              put: bool) -> None:
        """A call of ``n`` pages (``statuses``: their objects, component-major) that took
        ``seconds``, on ``view`` (a ``PoolView``: a page's bytes, all its objects)."""
        if not self.enabled or n == 0 or seconds <= 0:
            return
        if statuses.count(Status.OK) == len(statuses):
            pages = n
        else:  # the pages whose every object is OK
            ok = np.fromiter((s is Status.OK for s in statuses), dtype=bool,
                             count=len(statuses))
            pages = int(ok.reshape(-1, n).all(axis=0).sum())
        if pages == 0:
            return
        side = "backup" if put else "prefetch"
        with self._lock:
            self._lists[f"{side}_pgs"].append(pages)
            self._lists[f"{side}_bandwidth"].append(
                pages * sum(view.page_bytes) / 2**30 / seconds)

    def take(self):
        """SGLang's ``StorageMetrics`` of the calls since the last take, or None when
        SGLang's metrics module does not import."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        with self._lock:
            taken = {name: values[:] for name, values in self._lists.items()}
            for values in self._lists.values():
                values.clear()
        return StorageMetrics(**taken)
