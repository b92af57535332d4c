"""Fixtures for the SGLang interop tests: the real SGLang 0.5.23 classes on a CPU (host pools,
HiCacheStorageConfig, the storage backend factory, SGLang's own MooncakeStore) against a real
embedded Mooncake master. Run through scripts/test_sglang.sh (its own venv, .venv-sglang)."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

# SGLang's config package imports torchvision at module level: a stand-in (tests only).
sys.path.insert(0, str(Path(__file__).parent / "stand_ins"))

import kvmove

LAYERS = 4
MLA_DIM = 576  # kv_lora_rank 512 + qk_rope_head_dim 64 (bf16: 1152-byte rows)
HEADS, HEAD_DIM = 2, 64


@pytest.fixture(scope="session")
def master():
    """A private mooncake_master on loopback; SGLang's MOONCAKE_* variables point at it."""
    m = kvmove.EmbeddedMaster()
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update({
        "MOONCAKE_MASTER": m.address,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(256 << 20),
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
    })
    yield m
    # SGLang's MooncakeStore.close() leaves its Mooncake client open; close each while the
    # master is still there (a client whose master is gone takes seconds to close).
    while SGLANG_BACKENDS:
        SGLANG_BACKENDS.pop().store.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    m.stop()


ENV = ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL", "MOONCAKE_DEVICE", "MOONCAKE_TE_META_DATA_SERVER",
       "MOONCAKE_GLOBAL_SEGMENT_SIZE", "MOONCAKE_LOCAL_HOSTNAME")


def storage_config(*, mla: bool, page_first: bool, model: str, tp_rank: int = 0,
                   extra: dict | None = None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=page_first,
        model_name=model, extra_config=dict(extra or {}),
    )


def kvmove_backend(config):
    """kvmove's backend, created the way SGLang creates a "dynamic" backend."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config.extra_config.update({"backend_name": "kvmove",
                                "module_path": "kvmove.integrations.sglang",
                                "class_name": "KVMoveStorage", "interface_v1": 1})
    return StorageBackendFactory.create_backend("dynamic", config, None)


SGLANG_BACKENDS: list = []  # SGLang backends made this session (see ``master``)


def sglang_backend(config):
    """SGLang's own Mooncake backend."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    backend = MooncakeStore(config)
    SGLANG_BACKENDS.append(backend)
    return backend


def fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))
    return t


def mla_pool(layout: str, *, page_size: int, tokens: int, seed: int):
    """A CPU MLATokenToKVPoolHost of ``tokens`` slots, filled with random bytes."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = [torch.zeros(tokens // 2, 1, MLA_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    info = MLABufferInfo(
        buffers=tuple(device), data_ptrs=torch.tensor([t.data_ptr() for t in device]),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=page_size,
        kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=MLA_DIM, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=tokens // 2, start_layer=0,
        end_layer=LAYERS, target_layer_num=LAYERS)
    fill(pool.kv_buffer, seed)
    return pool


def mha_pool(layout: str, *, page_size: int, tokens: int, seed: int):
    """A CPU MHATokenToKVPoolHost of ``tokens`` slots, filled with random bytes."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = [torch.zeros(tokens // 2, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.zeros(tokens // 2, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    buffers = KVBuffers(k=tuple(k), v=tuple(v),
                        k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                        v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                        layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=buffers, page_size=page_size, head_num=HEADS,
                         head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=tokens // 2, start_layer=0,
        end_layer=LAYERS)
    fill(pool.kv_buffer, seed)
    return pool


def page_data(pool, page: int) -> bytes:
    """The bytes of one page of a host pool (SGLang's own accessor)."""
    return pool.get_data_page(page * pool.page_size).contiguous().view(torch.uint8) \
        .numpy().tobytes()


@pytest.fixture
def model():
    """A model name unique to the test: its keys are its own."""
    return f"org/model-{uuid.uuid4().hex[:10]}"


INDEXER_PAGE_BYTES = 132 * 4  # one fp8 indexer row with its scale, x page tokens


def indexer_pool(layout: str, *, page_size: int, pages: int, seed: int):
    """A DSAIndexerPoolHost with the buffer SGLang allocates for ``layout`` (``[pages, L, 1,
    page_bytes]``), filled with random bytes. Built without its device pool (a DSA device
    pool needs a GPU): only the attributes its storage methods read are set, and SGLang's
    own get_page_buffer_meta / get_hybrid_pool_buffer run on them."""
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    pool = object.__new__(DSAIndexerPoolHost)
    pool.layout, pool.page_size, pool.layer_num = layout, page_size, LAYERS
    pool.indexer_dtype = torch.uint8
    pool.indexer_page_stride_size = INDEXER_PAGE_BYTES
    pool.index_k_with_scale_buffer = fill(
        torch.zeros(pages, LAYERS, 1, INDEXER_PAGE_BYTES, dtype=torch.uint8), seed)
    return pool
