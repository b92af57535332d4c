"""Store keys namespaced by the cache geometry and the object layout, so that a process whose
cache has another geometry (buffers, layer counts, row bytes, dtypes, page size) or whose
staging has another layout (layer_first or page_first objects) can never read bytes it would
misinterpret."""

from __future__ import annotations

import hashlib
import json
import re

from kvmove.checks import check_layout
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import LAYOUTS

_PREFIX_OK = re.compile(r"[A-Za-z0-9._\-]*")


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
    """Maps the engine's keys to store keys: ``kvm-<fingerprint>[-<prefix>]:<key>``.

    The fingerprint covers the cache geometry, the page size, the checksum trailer and the
    object ``layout``. ``prefix`` is the caller's own namespace (model name, tp rank, ...):
    letters, digits, ``.``, ``_`` and ``-``.
    """

    def __init__(self, kv: KVCache, page_tokens: int, prefix: str = "", *,
                 checksum: bool = False, layout: str = "layer_first"):
        if not isinstance(prefix, str) or not _PREFIX_OK.fullmatch(prefix):
            raise ValueError(
                f"key_prefix must use only letters, digits, '.', '_' and '-', got {prefix!r}"
            )
        self.layout = check_layout(layout, LAYOUTS)
        self.fingerprint = geometry_fingerprint(kv, page_tokens, checksum, layout)
        self.namespace = f"kvm-{self.fingerprint}" + (f"-{prefix}" if prefix else "")

    def store_keys(self, keys: list[str]) -> list[str]:
        head = self.namespace + ":"
        return [head + k for k in keys]


class RawKeys:
    """Keys used exactly as given, with no namespace: for objects whose keys another system
    defines (e.g. vLLM's ``MooncakeStoreConnector`` keys, which encode the model, ranks and
    block hash themselves). The caller owns the guarantee that one key always names one
    object format."""

    namespace = ""

    def store_keys(self, keys: list[str]) -> list[str]:
        return list(keys)
