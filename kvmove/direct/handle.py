"""``PageHandle``: what a :class:`~kvmove.PageReceiver` publishes and a
:class:`~kvmove.PageSender` writes by — the receiver's peer name, where each buffer's pages
are (the registered region and the strides inside it) and the pool's geometry (buffer
names, layers, row bytes, page tokens, layout, page count). It travels as a ``str``
(versioned JSON) through the engine's own bootstrap channel and is validated when parsed.

:class:`BufferPlace` places the bytes of one buffer: row ``token`` of ``layer`` in page
``page`` starts at ``origin + layer * layer_stride + page * page_stride + token *
token_stride`` and is ``row_bytes`` long. A host pool's buffer and a sender's staging are
both placed this way (a staging "page" is a slot).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass

from kvmove.memory.host_pool import HOST_LAYOUTS

__all__ = ["HANDLE_KIND", "HANDLE_VERSION", "BufferPlace", "PageHandle"]

HANDLE_KIND = "kvmove.PageHandle"
HANDLE_VERSION = 1
MAX_HANDLE_CHARS = 1 << 16
_PEER = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")
_INT_LIMIT = 1 << 63


@dataclass(frozen=True)
class BufferPlace:
    """Where the pages of one buffer live (see the module doc); ``address`` and ``nbytes``:
    the memory region that holds them all (what a receiver registers)."""

    name: str
    layers: int
    row_bytes: int
    origin: int
    layer_stride: int
    page_stride: int
    token_stride: int
    address: int
    nbytes: int

    @classmethod
    def of_view(cls, name: str, view, *, layout: str, layers: int, row_bytes: int,
                page_tokens: int, num_pages: int) -> BufferPlace:
        """The place of a uint8 view ``[L, pages, page_tokens * row_bytes]`` (layer-first
        and page_first_direct pools, a layer-first staging) or ``[pages, page_tokens, L,
        row_bytes]`` (``layout == "page_first"``); its region is exactly the bytes of its
        pages, from the first to the last."""
        if layout == "page_first":
            page_stride, token_stride, layer_stride = view.stride()[:3]
        else:
            layer_stride, page_stride, token_stride = view.stride(0), view.stride(1), row_bytes
        origin = view.data_ptr()
        extent = ((layers - 1) * layer_stride + (num_pages - 1) * page_stride
                  + (page_tokens - 1) * token_stride + row_bytes)
        return cls(name, layers, row_bytes, origin, layer_stride, page_stride, token_stride,
                   origin, extent)

    def check(self, layout: str, page_tokens: int, num_pages: int) -> None:
        """``ValueError`` unless the fields are a ``layout`` pool's (rows apart, strides as
        the layout has them) and every row of every page lies inside the region."""
        what = f"buffer {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"buffer names must be non-empty strings, got {self.name!r}")
        for field, value in asdict(self).items():
            if field != "name" and (isinstance(value, bool) or not isinstance(value, int)
                                    or not 0 < value < _INT_LIMIT):
                raise ValueError(f"{what}: {field} must be a positive int, got {value!r}")
        row, p, n, layers = self.row_bytes, page_tokens, num_pages, self.layers
        expected = {  # field -> (the value it must have or exceed, must it equal)
            "layer_first": {"token_stride": (row, True), "page_stride": (p * row, True),
                            "layer_stride": (n * p * row, False)},
            "page_first": {"layer_stride": (row, True), "token_stride": (layers * row, True),
                           "page_stride": (p * layers * row, True)},
            "page_first_direct": {"token_stride": (row, True), "layer_stride": (p * row, True),
                                  "page_stride": (layers * p * row, False)},
        }[layout]
        for field, (want, equal) in expected.items():
            got = getattr(self, field)
            wrong = got != want if equal else got < want
            if wrong:
                raise ValueError(f"{what}: a {layout} pool has {field} "
                                 f"{'' if equal else '>= '}{want}, the handle says {got}")
        end = (self.origin + (layers - 1) * self.layer_stride + (n - 1) * self.page_stride
               + (p - 1) * self.token_stride + row)
        if self.origin < self.address or end > self.address + self.nbytes:
            raise ValueError(f"{what}: its pages ({self.origin:#x}..{end:#x}) are not inside "
                             f"its region ({self.address:#x} + {self.nbytes})")


@dataclass(frozen=True)
class PageHandle:
    """A receiver's handle (see the module doc). ``str(handle)`` / :meth:`encode` is what
    travels; :meth:`parse` checks one."""

    peer: str
    layout: str
    page_tokens: int
    num_pages: int
    buffers: tuple[BufferPlace, ...]

    def __post_init__(self):
        if not isinstance(self.peer, str) or not _PEER.fullmatch(self.peer):
            raise ValueError(f"peer must be a host:port name without spaces, got "
                             f"{self.peer!r:.80}")
        if self.layout not in HOST_LAYOUTS:
            raise ValueError(f"layout must be one of {HOST_LAYOUTS}, got {self.layout!r:.40}")
        for field in ("page_tokens", "num_pages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
                raise ValueError(f"{field} must be a positive int, got {value!r:.40}")
        if not self.buffers:
            raise ValueError("a handle names at least one buffer")
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"buffer names repeat: {names}")
        for b in self.buffers:
            b.check(self.layout, self.page_tokens, self.num_pages)
        regions = sorted((b.address, b.address + b.nbytes, b.name) for b in self.buffers)
        for (_, end, a), (start, _, b) in itertools.pairwise(regions):
            if start < end:
                raise ValueError(f"the regions of buffers {a!r} and {b!r} overlap")

    @property
    def geometry(self) -> dict[str, tuple[int, int]]:
        """buffer name -> (layers, row bytes)."""
        return {b.name: (b.layers, b.row_bytes) for b in self.buffers}

    def encode(self) -> str:
        body = {"kind": HANDLE_KIND, "version": HANDLE_VERSION, "peer": self.peer,
                "layout": self.layout, "page_tokens": self.page_tokens,
                "num_pages": self.num_pages, "buffers": [asdict(b) for b in self.buffers]}
        return json.dumps(body, separators=(",", ":"))

    __str__ = encode

    @classmethod
    def parse(cls, text) -> PageHandle:
        """The handle ``text`` encodes (a :class:`PageHandle` is returned as it is).
        ``TypeError`` for a non-str, ``ValueError`` naming what is wrong otherwise."""
        if isinstance(text, PageHandle):
            return text
        if not isinstance(text, str):
            raise TypeError(f"handle must be a str (PageReceiver.handle), got "
                            f"{type(text).__name__}")
        if len(text) > MAX_HANDLE_CHARS:
            raise ValueError(f"handle: {len(text)} characters is too long for a page handle")
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"handle: not a kvmove page handle (not JSON: {e})") from None
        if not isinstance(body, dict) or body.get("kind") != HANDLE_KIND:
            raise ValueError("handle: not a kvmove page handle (PageReceiver.handle)")
        if body.get("version") != HANDLE_VERSION:
            raise ValueError(f"handle: version {body.get('version')!r:.20} is not the one this "
                             f"kvmove reads ({HANDLE_VERSION}); sender and receiver must run "
                             f"compatible kvmove versions")
        fields = {"kind", "version", "peer", "layout", "page_tokens", "num_pages", "buffers"}
        if set(body) != fields:
            raise ValueError(f"handle: fields {sorted(body)}, expected {sorted(fields)}")
        buffers = body["buffers"]
        if not isinstance(buffers, list) or not all(isinstance(b, dict) for b in buffers):
            raise ValueError("handle: buffers must be a list of objects")
        names = set(BufferPlace.__dataclass_fields__)
        try:
            places = []
            for b in buffers:
                if set(b) != names:
                    raise ValueError(f"a buffer has fields {sorted(b)}, expected {sorted(names)}")
                places.append(BufferPlace(**b))
            return cls(body["peer"], body["layout"], body["page_tokens"], body["num_pages"],
                       tuple(places))
        except ValueError as e:
            raise ValueError(f"handle: {e}") from None
