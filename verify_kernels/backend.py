"""The Triton attention backend: the same two calls as `specdec.attention.TorchAttentionBackend`."""

from __future__ import annotations

import torch

from specdec.attention_metadata import AttentionMetadata
from verify_kernels import tree_attention as tree
from verify_kernels.decode_attention import decode_attention
from verify_kernels.fused_ops import rope_table
from verify_kernels.kv_ops import write_kv
from verify_kernels.paged_attention import choose_num_splits, paged_attention


class TritonAttentionBackend:
    """Steps that `fuses` go through `decode` (rotary, KV write and attention in one kernel)
    instead of a rotary + KV write launch and `attend`: one row per sequence
    (verify_kernels/decode_attention.py) when `fused_decode`; the same few rows per sequence in
    a small batch (verify_kernels/tree_attention.py: `tree.fuses`) when `fused_tree`. Off only
    to measure the difference."""

    name = "triton"
    fused_decode = True
    fused_tree = True

    def fuses(self, meta: AttentionMetadata, group: int = 1) -> bool:
        """`group`: query heads per KV head."""
        if meta.all_decode:
            return self.fused_decode
        return self.fused_tree and tree.fuses(meta, group)

    def step_rope(
        self,
        meta: AttentionMetadata,
        positions: torch.Tensor,  # [T] int64
        inv_freq: torch.Tensor,  # [D / 2] float32
        rope_scaling: float,
        group: int = 1,  # query heads per KV head
    ) -> torch.Tensor | None:  # [T, 2, D] float32
        """The step's rotary factors (fused_ops.rope_table), made once for every layer's
        `decode`, where the step's attention is the tree kernel's; else None."""
        if meta.all_decode or not self.fuses(meta, group):
            return None
        return rope_table(positions, inv_freq, rope_scaling)

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

    def decode(
        self,
        q: torch.Tensor,  # [T, Hq, D] unrotated (T = B, or B x rows for a tree step)
        k: torch.Tensor,  # [T, Hkv, D] unrotated
        v: torch.Tensor,  # [T, Hkv, D]
        positions: torch.Tensor,  # [T] int64
        inv_freq: torch.Tensor,  # [D / 2] float32
        rope_scaling: float,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        num_splits: int | None = None,
        rope: torch.Tensor | None = None,  # `step_rope`'s factors (tree steps; None: made here)
        pdl: bool = False,  # programmatic dependent launch for the decode kernel (pdl.py)
    ) -> torch.Tensor:  # [T, Hq, D]
        if num_splits is None:
            num_splits = choose_num_splits(meta, q.shape[1], k.shape[1], q.device)
        if meta.all_decode:
            return decode_attention(q, k, v, positions, inv_freq, rope_scaling, k_cache,
                                    v_cache, meta, scale, num_splits, pdl=pdl)
        return tree.tree_attention(q, k, v, positions, inv_freq, rope_scaling, k_cache, v_cache,
                                   meta, scale, num_splits, rope=rope)

