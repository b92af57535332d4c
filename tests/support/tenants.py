"""A store on an embedded master that keeps Mooncake tenants apart: the master needs
``-enable_multi_tenants`` and a quota policy naming every tenant (a tenant not in the policy
is refused, ``TENANT_NOT_REGISTERED``)."""

from __future__ import annotations

from pathlib import Path

import kvmove

TENANT_QUOTA_BYTES = 256 << 20


def multi_tenant_store(folder: Path, tenants=("default", "team-a"), **overrides
                       ) -> kvmove.MooncakeStore:
    """A default-tenant store (64 MiB segment unless ``overrides`` say otherwise) on a new
    embedded master whose quota policy, written into ``folder``, registers ``tenants``."""
    policy = Path(folder) / "tenant-quota.yaml"
    policy.write_text("version: 1\ntenants:\n" + "".join(
        f"  - name: {t}\n    quota: {TENANT_QUOTA_BYTES}\n" for t in tenants))
    overrides.setdefault("global_segment_size", 64 << 20)
    return kvmove.MooncakeStore.embedded(
        master_args=["-enable_multi_tenants=true", f"-tenant_quota_connector_uri={policy}"],
        **overrides)
