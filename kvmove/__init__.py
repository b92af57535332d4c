"""kvmove: move KV-cache bytes between a GPU KV cache, layer-first pinned staging and the
Mooncake store. See API.md for the contract."""

from kvmove.cache import KVCache
from kvmove.copy import copy_rows, gather, scatter
from kvmove.errors import KVMoveError, StagingFull, StoreError
from kvmove.staging import StagingBuffer
from kvmove.status import Status

__all__ = [
    "KVCache",
    "KVMoveError",
    "StagingBuffer",
    "StagingFull",
    "Status",
    "StoreError",
    "copy_rows",
    "gather",
    "scatter",
]
__version__ = "0.1.0"
