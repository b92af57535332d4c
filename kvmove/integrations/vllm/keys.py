"""vLLM's Mooncake store keys, as ``MooncakeStoreConnector`` writes them (rank-local layout).

One key per KV block::

    [cache_prefix@]{model basename}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hash hex}

where the hash is vLLM's chained block hash of that block (for a block size larger than the
hash block size, the last hash inside the block). Pure Python: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankNamespace:
    """The ranks a key names: tensor-, prefill-context-, decode-context- and pipeline-
    parallel rank."""

    tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0


@dataclass(frozen=True)
class VLLMKeyFormat:
    """The key namespace of one model and KV cache group."""

    model_name: str
    group_id: int = 0
    cache_prefix: str = ""

    @staticmethod
    def model_basename(model: str) -> str:
        """vLLM's ``model_name``: the last component of the model path or name."""
        return model.rstrip("/").split("/")[-1]

    def prefix(self, ranks: RankNamespace) -> str:
        head = f"{self.cache_prefix}@" if self.cache_prefix else ""
        return (
            f"{head}{self.model_name}"
            f"@tp_rank:{ranks.tp_rank}@pcp{ranks.pcp_rank}@dcp{ranks.dcp_rank}"
            f"@pp_rank:{ranks.pp_rank}@group:{self.group_id}"
        )

    def keys(self, ranks: RankNamespace, block_hashes: Sequence[bytes]) -> list[str]:
        """One key per block hash, for the objects of ``ranks``."""
        head = self.prefix(ranks) + "@"
        return [head + bytes(h).hex() for h in block_hashes]


def block_hashes(request_hashes: Sequence[bytes], hash_block_size: int,
                 block_size: int) -> list[bytes]:
    """One hash per ``block_size`` block: the block's last ``hash_block_size`` hash (vLLM's
    chained hashes make it name the whole prefix up to that block)."""
    if block_size == hash_block_size:
        return list(request_hashes)
    if block_size % hash_block_size:
        raise ValueError(f"block_size {block_size} is not a multiple of the hash block size "
                         f"{hash_block_size}")
    scale = block_size // hash_block_size
    return list(request_hashes[scale - 1::scale])
