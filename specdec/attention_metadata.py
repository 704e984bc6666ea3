"""A step's attention metadata: the contract between the model runner and every attention backend.

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads,
head_dim]. Token t of a sequence lives at slot `block_table[t // block_size] * block_size +
t % block_size`.

A step's query tokens are flattened over a ragged batch. Sequence b owns query rows
`query_start[b]:query_start[b+1]` (q_len_b of them). Its first `context_lens[b]` KV entries were
written by earlier steps; query row j is written this step at KV index `context_lens[b] + j`
(its slot is `slot_mapping[row]`). Row j attends to every prefix entry and to the step's rows k
allowed by the mask: causal (k <= j) unless `mask_offsets[b] >= 0`, in which case the q_len_b x
q_len_b boolean matrix stored row-major at `custom_mask[mask_offsets[b]:]` decides (draft trees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    query_start: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, KV entries before this step
    seq_lens: torch.Tensor  # [B] int32, context_lens + q_lens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    custom_mask: torch.Tensor | None  # [M] bool, flattened per-sequence q_len x q_len masks
    mask_offsets: torch.Tensor  # [B] int64, -1 = causal
    # Host copies, so that the launch path never synchronises with the device.
    q_lens_host: tuple[int, ...]
    context_lens_host: tuple[int, ...]
    mask_offsets_host: tuple[int, ...]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max((c + q for c, q in zip(self.context_lens_host, self.q_lens_host)), default=0)

    @property
    def all_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens_host)
