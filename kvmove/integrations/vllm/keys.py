"""vLLM's Mooncake store keys, as ``MooncakeStoreConnector`` writes them (rank-local layout).

One key per KV block::

    [cache_prefix@]{model basename}@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}@group:{g}@{hash hex}

where the hash is vLLM's chained block hash of that block (for a block size larger than the
hash block size, the last hash inside the block). A request of a tenant (the connector's
``tenant``, its ``cache_salt``) has ``kvmt-<tag>/`` before the hash hex (docs/TENANCY.md).
Pure Python: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmove.objects.keys import resolve_tenant, tenant_head, tenant_tag


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
    """The key namespace of one model and KV cache group. ``tenant``: the connector's
    tenant (``None``: none); ``salted``: a request's ``cache_salt`` joins its tenant."""

    model_name: str
    group_id: int = 0
    cache_prefix: str = ""
    tenant: str | None = None
    salted: bool = True

    def with_tenant(self, extra: dict | None) -> VLLMKeyFormat:
        """This format with ``kv_connector_extra_config``'s ``tenant`` (else
        ``KVMOVE_TENANT``) and ``tenant_from_salt`` (default true)."""
        extra = extra or {}
        salted = extra.get("tenant_from_salt", True)
        if str(salted).lower() not in ("true", "false"):
            raise ValueError(f"kv_connector_extra_config tenant_from_salt must be true or "
                             f"false, got {salted!r}")
        tenant = extra.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"kv_connector_extra_config tenant must be a string, got "
                             f"{tenant!r}")
        return replace(self, tenant=resolve_tenant(tenant),
                       salted=str(salted).lower() == "true")

    def tenant_part(self, request) -> str:
        """What goes before the hash hex in ``request``'s keys: ``""`` (vLLM's own keys)
        when it has no tenant, else ``kvmt-<tag>/``."""
        salt = getattr(request, "cache_salt", None) if self.salted else None
        if self.tenant is None and not salt:
            return ""
        return tenant_head(tenant_tag(self.tenant, salt))

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

    def keys(self, ranks: RankNamespace, block_hashes: Sequence[bytes],
             tenant_part: str = "") -> list[str]:
        """One key per block hash, for the objects of ``ranks`` (of the tenant whose
        :meth:`tenant_part` is given)."""
        head = self.prefix(ranks) + "@" + tenant_part
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
