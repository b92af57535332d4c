"""The Triton backend's side of a copy: the kernel arguments that depend on geometry alone
(per-layer address tables on the device, their common alignment, the launch config),
worked out once, and the launch with a call's row indices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmove.kernels.alignment import pow2_alignment
from kvmove.kernels.configs import LaunchConfig
from kvmove.memory.row_pool import BufferRows
from kvmove.metrics import record as metrics
from kvmove.rows.launch_config import config_for


@dataclass(frozen=True)
class KernelArgs:
    """What one buffer's kernel launch needs besides the indices."""

    src: BufferRows
    dst: BufferRows
    src_table: torch.Tensor  # int64 [L] device addresses of the selected layers
    dst_table: torch.Tensor
    alignment: int  # a power of two dividing every address in both tables
    config: LaunchConfig


def kernel_args(src: BufferRows, dst: BufferRows, layers: tuple[int, ...],
                device: torch.device, *, direction: str, page_tokens: int) -> KernelArgs:
    return KernelArgs(
        src, dst,
        src_table=src.address_table(layers, device),
        dst_table=dst.address_table(layers, device),
        alignment=pow2_alignment(*(src.device_addresses[i] for i in layers),
                                 *(dst.device_addresses[i] for i in layers)),
        config=config_for(device, direction, src.row_bytes, page_tokens),
    )


def launch(args: KernelArgs, src_rows: torch.Tensor, dst_rows: torch.Tensor,
           errors: torch.Tensor | None, pages: tuple[int, int] = (0, 0)) -> None:
    """One launch on the current stream; the row tensors on the tables' device. ``pages``:
    per side, 0 when its tensor holds rows, ``P`` when it holds slots of ``P``-row pages."""
    from kvmove.kernels.row_copy import copy_rows  # imports Triton: on first use

    s, d = args.src, args.dst
    copy_rows(args.src_table, args.dst_table, src_rows, dst_rows, errors,
              src_limit=s.num_rows, dst_limit=d.num_rows, src_pitch=s.pitch, dst_pitch=d.pitch,
              row_bytes=s.row_bytes, base_alignment=args.alignment, config=args.config,
              src_page_tokens=pages[0], dst_page_tokens=pages[1])
    metrics.programs(args.config.max_programs)
