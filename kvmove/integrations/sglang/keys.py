"""The store keys of SGLang's own Mooncake backend (sglang 0.5.23,
``mem_cache/storage/mooncake_store/mooncake_store.py``), so that kvmove and SGLang share
objects:

- a prefix: the optional ``extra_backend_tag``, then the model name with ``/`` replaced by
  ``-``, joined by ``_``; a page key becomes ``<prefix>_<page hash>`` (no prefix: the hash);
- MLA: ``<page key>_<mla suffix>_k``, the suffix empty at pp_size 1 (``<hash>__k``), the pp
  rank otherwise;
- MHA: ``<page key>_<tp rank>[_<pp rank>]_k`` and ``..._v``;
- a side pool (the DSA indexer): ``<page key>_<mla suffix>_<pool name>``.

A backend of a tenant (``extra_config["tenant"]``, else ``KVMOVE_TENANT``) puts
``kvmt-<tag>/`` before every key (docs/TENANCY.md); without one the keys are SGLang's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmove.objects.keys import resolve_tenant, tenant_head, tenant_tag


class SGLangKeys:
    """Key names for one SGLang rank's storage config (and tenant, :attr:`tenant`)."""

    def __init__(self, storage_config):
        extra = getattr(storage_config, "extra_config", None) or {}
        tenant = extra.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"extra_config tenant must be a string, got {tenant!r}")
        self.tenant = resolve_tenant(tenant)
        parts = []
        if extra.get("extra_backend_tag") is not None:
            parts.append(str(extra["extra_backend_tag"]))
        if getattr(storage_config, "model_name", None):
            parts.append("-".join(storage_config.model_name.split("/")))
        self.prefix = "_".join(parts) if parts else None
        # what a key starts with: the tenant's head, then SGLang's prefix
        self._head = (tenant_head(tenant_tag(self.tenant))
                      + ("" if self.prefix is None else self.prefix + "_"))
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        if pp_size > 1:
            self.mha_suffix, self.mla_suffix = f"{tp_rank}_{pp_rank}", f"{pp_rank}"
        else:
            self.mha_suffix, self.mla_suffix = f"{tp_rank}", ""

        # The suffixes of a page's KV objects, in SGLang's order.
        self.suffixes: tuple[str, ...] = ((f"_{self.mla_suffix}_k",) if self.is_mla else
                                          (f"_{self.mha_suffix}_k", f"_{self.mha_suffix}_v"))

    def kv_objects(self, keys: Sequence[str]) -> list[list[str]]:
        """Per component (MLA: one, MHA: k then v), the object key of every page (one pass
        over the keys per component: prefix and suffix in one string)."""
        head = self._head
        if len(self.suffixes) == 1:  # MLA: one comprehension, not two nested
            suffix = self.suffixes[0]
            return [[f"{head}{k}{suffix}" for k in keys]]
        return [[f"{head}{k}{suffix}" for k in keys] for suffix in self.suffixes]

    def side_objects(self, keys: Sequence[str], pool_name: str) -> list[str]:
        """The object key of every page of side pool ``pool_name`` (e.g. ``indexer``)."""
        head = self._head
        suffix = f"_{self.mla_suffix}_{pool_name}"
        return [f"{head}{k}{suffix}" for k in keys]
