"""The mover: ``KVMover`` (the front: build, evict, prefetch, stats, close), the
``Request`` each call is validated into, the staged and in-place paths that carry calls
out, the ``Transfer`` a call returns, the threads its store jobs run on, and the path
choice with the probe behind it."""

from kvmove.mover.kv_mover import KVMover, MoverStats, layer_groups
from kvmove.mover.transfer import Transfer

__all__ = ["KVMover", "MoverStats", "Transfer", "layer_groups"]
