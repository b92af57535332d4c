"""A tuning workload: scratch KV rows on a GPU and pinned staging for one shape, and the
functions that run the kernel (with a given config) or a public copy over them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvmove.kernels.alignment import pow2_alignment
from kvmove.kernels.configs import LaunchConfig
from kvmove.kernels.row_copy import copy_rows as launch
from kvmove.memory.cache import KVCache
from kvmove.memory.staging import StagingBuffer
from kvmove.rows.moves import gather, scatter


class Workload:
    """Scratch KV rows on the device and pinned staging for one shape: a random permutation
    of whole KV pages to contiguous staging slots, ``nbytes`` moved per copy."""

    def __init__(self, device: torch.device, row_bytes: int, page_tokens: int, *,
                 layers: int, target_bytes: int, seed: int = 0):
        pages = max(1, target_bytes // (layers * page_tokens * row_bytes))
        rows = pages * page_tokens
        g = torch.Generator(device=device).manual_seed(seed)
        data = torch.randint(0, 256, (layers, rows, row_bytes), dtype=torch.uint8,
                             device=device, generator=g)
        self.kv = KVCache({"kv": data})
        self.staging = StagingBuffer(self.kv, num_slots=pages, page_tokens=page_tokens)
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        self.token_pages = perm[:, None] * page_tokens + torch.arange(page_tokens)[None, :]
        self.slots = torch.arange(pages)
        self.layers, self.page_tokens, self.row_bytes = layers, page_tokens, row_bytes
        self.nbytes = layers * rows * row_bytes
        self.device = device
        staging_rows = self.slots[:, None] * page_tokens + torch.arange(page_tokens)[None, :]
        kv_rows = self.token_pages.reshape(-1).to(device)
        staging_rows = staging_rows.reshape(-1).to(device)
        self._rows = {"gather": (kv_rows, staging_rows), "scatter": (staging_rows, kv_rows)}

    def launcher(self, direction: str) -> Callable[[LaunchConfig], None]:
        """A function that runs the kernel for this shape with a given config."""
        src, dst = ((self.kv.row_pool, self.staging.row_pool) if direction == "gather"
                    else (self.staging.row_pool, self.kv.row_pool))
        s_buf, d_buf = src.buffers["kv"], dst.buffers["kv"]
        layers = tuple(range(self.layers))
        tables = s_buf.address_table(layers, self.device), d_buf.address_table(layers, self.device)
        s_rows, d_rows = self._rows[direction]
        alignment = pow2_alignment(*s_buf.device_addresses, *d_buf.device_addresses)

        def run(config: LaunchConfig) -> None:
            launch(*tables, s_rows, d_rows, None, src_limit=s_buf.num_rows,
                   dst_limit=d_buf.num_rows, src_pitch=s_buf.pitch, dst_pitch=d_buf.pitch,
                   row_bytes=self.row_bytes, base_alignment=alignment, config=config)

        return run

    def copier(self, direction: str, backend: str) -> Callable[[], None]:
        """A function that runs the public gather/scatter with ``backend``."""
        if direction == "gather":
            return lambda: gather(self.kv, self.staging, self.token_pages, self.slots,
                                  backend=backend, check=False)
        return lambda: scatter(self.staging, self.slots, self.kv, self.token_pages,
                               backend=backend, check=False)

    def close(self) -> None:
        self.staging.close()
