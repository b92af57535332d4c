"""kvmove: move KV-cache bytes between a GPU KV cache, layer-first pinned staging and the
Mooncake store. See API.md for the contract."""

from kvmove.cache import KVCache
from kvmove.copy import copy_rows, gather, scatter
from kvmove.describe import Descriptors, describe
from kvmove.embedded_master import EmbeddedMaster
from kvmove.errors import KVMoveError, StagingFull, StoreError
from kvmove.host_pool import HostPool
from kvmove.mover import KVMover
from kvmove.staging import StagingBuffer
from kvmove.status import Status
from kvmove.store import MooncakeStore, StoreResult
from kvmove.store_config import StoreConfig
from kvmove.transfer import Transfer

__all__ = [
    "Descriptors",
    "EmbeddedMaster",
    "HostPool",
    "KVCache",
    "KVMoveError",
    "KVMover",
    "MooncakeStore",
    "StagingBuffer",
    "StagingFull",
    "Status",
    "StoreConfig",
    "StoreError",
    "StoreResult",
    "Transfer",
    "copy_rows",
    "describe",
    "gather",
    "scatter",
]
__version__ = "0.1.0"
