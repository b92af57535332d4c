"""``StagingBuffer``: host staging for the pages of a :class:`~kvmove.KVCache`, per buffer
layer-first ``[L, num_slots, page_tokens * row_bytes]`` or page-first ``[num_slots,
page_tokens, L, row_bytes]``, with a thread-safe slot allocator."""

from __future__ import annotations

import torch

from kvmove.checks import check_layout, check_positive_int
from kvmove.errors import StagingInUse
from kvmove.memory import host_memory
from kvmove.memory.cache import KVCache
from kvmove.memory.host_memory import HostMemory
from kvmove.memory.row_pool import BufferRows, RowPool
from kvmove.memory.slot_allocator import SlotAllocator

LAYOUTS = ("layer_first", "page_first")


class StagingBuffer:
    """Staging for the pages of ``kv``, per buffer one uint8 tensor:

    - ``layout="layer_first"`` (default): ``[L, num_slots, page_tokens * row_bytes]``; slot
      ``s`` of layer ``l`` holds one page (``page_tokens`` token rows) of that layer. A key's
      object is one span per layer (``[layer][token][row]``).
    - ``layout="page_first"``: ``[num_slots, page_tokens, L, row_bytes]``; slot ``s`` holds
      the page token by token, every layer's row of a token side by side. A key's object is
      one contiguous span per buffer (``[token][layer][row]``, SGLang's ``page_first``).

    Pinned and device-accessible when ``kv`` lives on CUDA, page-aligned host memory
    otherwise. Either way it is a row pool: row ``slot * page_tokens + t`` is token ``t`` of
    slot ``slot`` (the layouts differ only in where a layer's rows start and their pitch).
    """

    # Its tensors are made once, here, and never replaced: what describes them may cache
    # their addresses.
    fixed_memory = True

    def __init__(self, kv: KVCache, num_slots: int = 1024, page_tokens: int = 64, *,
                 trailer_bytes: int = 0, layout: str = "layer_first"):
        if not isinstance(kv, KVCache):
            raise TypeError(f"kv must be a kvmove.KVCache, got {type(kv).__name__}")
        check_positive_int(num_slots, "num_slots")
        check_positive_int(page_tokens, "page_tokens")
        if isinstance(trailer_bytes, bool) or not isinstance(trailer_bytes, int) or (
                trailer_bytes < 0):
            raise ValueError(f"trailer_bytes must be an int >= 0, got {trailer_bytes!r}")
        self.layout = check_layout(layout, LAYOUTS)
        self.kv = kv
        self.num_slots = num_slots
        self.page_tokens = page_tokens
        pin = host_memory.pinning_for(kv.device)
        self._memory: dict[str, HostMemory] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        rows = []
        for name in kv.buffer_names:
            layers, row_bytes = kv.num_layers(name), kv.row_bytes(name)
            page_bytes = page_tokens * row_bytes
            memory = HostMemory(layers * num_slots * page_bytes, pin=pin)
            num_rows = num_slots * page_tokens
            if layout == "layer_first":
                tensor = memory.tensor.view(layers, num_slots, page_bytes)
                token_rows = memory.tensor.view(layers, num_rows, row_bytes)
                views = tuple(token_rows[i] for i in range(layers))
                layer_step, pitch = num_slots * page_bytes, row_bytes
            else:
                tensor = memory.tensor.view(num_slots, page_tokens, layers, row_bytes)
                token_rows = memory.tensor.view(num_rows, layers, row_bytes)
                views = tuple(token_rows[:, i] for i in range(layers))
                layer_step, pitch = row_bytes, layers * row_bytes
            self._memory[name] = memory
            self._tensors[name] = tensor
            rows.append(
                BufferRows(
                    name=name,
                    layers=views,
                    row_bytes=row_bytes,
                    pitch=pitch,
                    num_rows=num_rows,
                    device=torch.device("cpu"),
                    dtype=torch.uint8,
                    row_shape=(row_bytes,),
                    device_addresses=tuple(
                        memory.device_address + i * layer_step for i in range(layers)
                    ),
                )
            )
        self._pool = RowPool(rows, kind="StagingBuffer")
        self._slots = SlotAllocator(num_slots)
        # Per slot, a few bytes stored after the page's rows (kvmove's object checksum).
        self.trailer_bytes = trailer_bytes
        self._trailer = HostMemory(num_slots * trailer_bytes, pin=pin) if trailer_bytes else None

    # -- memory ---------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """The uint8 staging tensor of ``name``: ``[L, num_slots, page_tokens * row_bytes]``
        (layer_first) or ``[num_slots, page_tokens, L, row_bytes]`` (page_first)."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r}; buffers are {self.buffer_names}") from None

    @property
    def trailer(self) -> torch.Tensor | None:
        """uint8 ``[num_slots, trailer_bytes]``, or None when ``trailer_bytes`` is 0."""
        if self._trailer is None:
            return None
        return self._trailer.tensor.view(self.num_slots, self.trailer_bytes)

    def regions(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each buffer's staging memory (and the trailer region, if
        any), to register with a store."""
        memories = [*self._memory.values(), *([self._trailer] if self._trailer else [])]
        return [(m.address, m.nbytes) for m in memories]

    @property
    def pinned(self) -> bool:
        return all(m.pinned for m in self._memory.values())

    @property
    def registrations(self) -> list[tuple[int, int]]:
        """The ``(address, nbytes)`` ranges registered with the device now: one per region
        of :meth:`regions` while pinned (no copy or store span crosses from one into
        another), none on the CPU or after :meth:`close`."""
        memories = [*self._memory.values(), *([self._trailer] if self._trailer else [])]
        return [r for m in memories for r in m.registrations]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._memory.values())

    def page_bytes(self, name: str) -> int:
        return self.page_tokens * self.kv.row_bytes(name)

    @property
    def object_bytes(self) -> int:
        """Bytes of one full page's store object: every layer of every buffer."""
        return sum(self.page_bytes(n) * self.kv.num_layers(n) for n in self.buffer_names)

    # -- geometry (the cache's) -----------------------------------------------------------
    @property
    def buffer_names(self) -> list[str]:
        return self.kv.buffer_names

    def num_layers(self, name: str) -> int:
        return self.kv.num_layers(name)

    def row_bytes(self, name: str) -> int:
        return self.kv.row_bytes(name)

    @property
    def num_rows(self) -> int:
        return self.num_slots * self.page_tokens

    @property
    def row_pool(self) -> RowPool:
        return self._pool

    # -- slots ----------------------------------------------------------------------------
    def alloc(self, n: int, *, timeout: float | None = 0.0) -> torch.Tensor:
        """``n`` free slot ids (int64). Raises :class:`kvmove.StagingFull` when fewer than
        ``n`` are free (after waiting up to ``timeout`` seconds; ``None`` waits forever),
        allocating nothing."""
        return self._slots.alloc(n, timeout=timeout)

    def free(self, slots) -> None:
        """Return ``slots`` to the pool; a slot that is not allocated raises ``ValueError``."""
        self._slots.free(slots)

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_allocated(self) -> int:
        """Slots allocated now (by transfers that may still use their memory)."""
        return self.num_slots - self._slots.num_free

    def close(self, *, timeout: float | None = 0.0, force: bool = False) -> None:
        """Unpin the staging memory (on CUDA); the tensors stay readable on the host.
        Idempotent.

        A transfer holds its slots until its copies are done, so while any slot is allocated
        the memory may still be read or written by a copy in flight. ``close`` first waits
        up to ``timeout`` seconds (``None``: forever) for every slot to be freed, then raises
        :class:`kvmove.StagingInUse` (unpinning nothing) if some still are, unless ``force``
        is true: then the caller vouches that no copy uses the memory any more."""
        if not force and not self._slots.wait_all_free(timeout):
            raise StagingInUse(
                f"closing the staging while {self.num_allocated} of {self.num_slots} slots "
                f"are allocated: a transfer may still use their memory; wait for the "
                f"transfers (or free their slots) first, or pass force=True")
        for memory in [*self._memory.values(), *([self._trailer] if self._trailer else [])]:
            memory.close()

    def __repr__(self) -> str:
        return (
            f"StagingBuffer({self.layout}, {self.num_slots} slots x {self.page_tokens} tokens, "
            f"{self.nbytes / 2**20:.1f} MiB, {'pinned' if self.pinned else 'pageable'}, "
            f"{self.num_free} free)"
        )
