"""Store keys namespaced by the cache geometry and the object layout, so that a process whose
cache has another geometry (buffers, layer counts, row bytes, dtypes, page size) or whose
staging has another layout (layer_first or page_first objects) can never read bytes it would
misinterpret, and optionally by a tenant, so that two tenants on one master never read each
other's objects (docs/TENANCY.md)."""

from __future__ import annotations

import hashlib
import json
import os
import re

from kvmove.checks import check_layout
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import LAYOUTS

_PREFIX_OK = re.compile(r"[A-Za-z0-9._\-]*")
_TENANT_NAME = re.compile(r"[A-Za-z0-9._\-]{1,64}")
TENANT_ENV = "KVMOVE_TENANT"


def resolve_tenant(tenant: str | None) -> str | None:
    """The tenant a key space is for: ``tenant``, or ``KVMOVE_TENANT`` where it is ``None``;
    stripped, and blank means none (so ``tenant=""`` turns an exported variable off)."""
    if tenant is None:
        tenant = os.environ.get(TENANT_ENV, "")
    if not isinstance(tenant, str):
        raise ValueError(f"tenant must be a str or None, got {tenant!r}")
    return tenant.strip() or None


def _digest(kind: str, text: str) -> str:
    return f"{kind}.{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def tenant_tag(tenant: str | None = None, salt: str | None = None) -> str:
    """The key part that names a tenant: ``""`` for none; ``t.<name>`` for a name of
    letters, digits, ``.``, ``_``, ``-`` (at most 64), else ``h.<32 hex>`` (its SHA-256);
    an engine's per-request ``salt`` adds ``s.<32 hex>`` (never written in clear), joined
    by ``+``. Different (tenant, salt) pairs never give the same tag (up to SHA-256)."""
    parts = []
    if tenant:
        parts.append(f"t.{tenant}" if _TENANT_NAME.fullmatch(tenant) else _digest("h", tenant))
    if salt:
        parts.append(_digest("s", salt))
    return "+".join(parts)


def tenant_head(tag: str) -> str:
    """What a raw key of tenant ``tag`` starts with (``""`` for no tenant): ``kvmt-<tag>/``;
    no engine's own key starts so."""
    return f"kvmt-{tag}/" if tag else ""


def geometry_fingerprint(kv: KVCache, page_tokens: int, checksum: bool = False,
                         layout: str = "layer_first") -> str:
    """12 hex digits that change whenever the object format would change (the layout
    included: a one-token page has the same size in both layouts, and other bytes)."""
    geometry = {
        "format": 1,
        "layout": layout,
        "page_tokens": page_tokens,
        "checksum": checksum,
        "buffers": [[n, layers, rb, dtype, list(shape)]
                    for n, layers, rb, dtype, shape in kv.geometry()],
    }
    blob = json.dumps(geometry, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


class KeySpace:
    """Maps the engine's keys to store keys: ``kvm-<fingerprint>[-<prefix>][/<tenant>]:<key>``.

    The fingerprint covers the cache geometry, the page size, the checksum trailer and the
    object ``layout``. ``prefix`` is the caller's own namespace (model name, tp rank, ...):
    letters, digits, ``.``, ``_`` and ``-``. ``tenant`` (else ``KVMOVE_TENANT``; blank:
    none) is written as :func:`tenant_tag` gives it.
    """

    def __init__(self, kv: KVCache, page_tokens: int, prefix: str = "", *,
                 checksum: bool = False, layout: str = "layer_first",
                 tenant: str | None = None):
        if not isinstance(prefix, str) or not _PREFIX_OK.fullmatch(prefix):
            raise ValueError(
                f"key_prefix must use only letters, digits, '.', '_' and '-', got {prefix!r}"
            )
        self.tenant = resolve_tenant(tenant)
        self.layout = check_layout(layout, LAYOUTS)
        self.fingerprint = geometry_fingerprint(kv, page_tokens, checksum, layout)
        tag = tenant_tag(self.tenant)
        self.namespace = (f"kvm-{self.fingerprint}" + (f"-{prefix}" if prefix else "")
                          + (f"/{tag}" if tag else ""))

    def store_keys(self, keys: list[str]) -> list[str]:
        head = self.namespace + ":"
        return [head + k for k in keys]


class RawKeys:
    """Keys used exactly as given, with no namespace: for objects whose keys another system
    defines (e.g. vLLM's ``MooncakeStoreConnector`` keys, which encode the model, ranks and
    block hash themselves). The caller owns the guarantee that one key always names one
    object format. With a ``tenant`` each key is preceded by :func:`tenant_head`; without
    one, keys stay byte-compatible with the other system's. ``KVMOVE_TENANT`` is not read
    here: the integration that owns such keys places the tenant itself."""

    namespace = ""
    tenant = None

    def __init__(self, tenant: str | None = None):
        self.tenant = resolve_tenant("" if tenant is None else tenant)
        self.namespace = tenant_head(tenant_tag(self.tenant))

    def store_keys(self, keys: list[str]) -> list[str]:
        head = self.namespace
        return [head + k for k in keys] if head else list(keys)
