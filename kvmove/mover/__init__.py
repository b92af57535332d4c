"""The mover: ``KVMover`` (evict, prefetch), the ``Transfer`` a call returns, the threads its
store jobs run on and the choice between the staged and in-place paths."""

from kvmove.mover.kv_mover import KVMover, MoverStats, layer_groups
from kvmove.mover.transfer import Transfer

__all__ = ["KVMover", "MoverStats", "Transfer", "layer_groups"]
