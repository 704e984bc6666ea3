"""The Triton attention backend: the same two calls as `specdec.attention.TorchAttentionBackend`."""

from __future__ import annotations

import torch

from specdec.attention import AttentionMetadata
from verify_kernels.kv_ops import write_kv
from verify_kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        return paged_attention(q, k_cache, v_cache, meta, scale)
