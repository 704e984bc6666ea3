"""Attention over the paged KV cache: the step's metadata and the PyTorch reference backend.

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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def write_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hkv, D]: a sequence's first `length` cache entries, in order."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    # index_select rather than advanced indexing: the same copy at a third of the CPU cost.
    return cache.index_select(0, block_table[:nb]).reshape(nb * bs, *cache.shape[2:])[:length]


def step_mask(meta: AttentionMetadata, b: int, device: torch.device) -> torch.Tensor | None:
    """[q_len, seq_len] bool mask of sequence b, or None where plain causal attention applies."""
    q, ctx, off = meta.q_lens_host[b], meta.context_lens_host[b], meta.mask_offsets_host[b]
    if off < 0:
        if ctx == 0 or q == 1:
            return None
        new = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    else:
        assert meta.custom_mask is not None
        new = meta.custom_mask[off:off + q * q].view(q, q)
    prefix = torch.ones(q, ctx, dtype=torch.bool, device=device)
    return torch.cat([prefix, new], dim=1)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Reference attention, one sequence at a time (decode-only batches in one padded call)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if meta.all_decode:
        return _decode_batch(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    start = 0
    for b, qlen in enumerate(meta.q_lens_host):
        seq_len = meta.context_lens_host[b] + qlen
        k = gather_kv(k_cache, meta.block_tables[b], seq_len)  # [S, Hkv, D]
        v = gather_kv(v_cache, meta.block_tables[b], seq_len)
        qb = q[start:start + qlen]  # [q, Hq, D]
        mask = step_mask(meta, b, q.device)
        causal = mask is None and qlen > 1
        o = F.scaled_dot_product_attention(
            qb.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=hq != hkv,
        )  # [Hq, q, D]
        out[start:start + qlen] = o.transpose(0, 1)
        start += qlen
    return out


def _decode_batch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query row per sequence. The g = Hq / Hkv query heads that share a KV head become g
    rows of one batched matmul per KV head, reading the gathered K and V in place (a head's
    [S, D] slice is a strided matrix BLAS takes as is): no repeated K/V, no transposed copies,
    and none of SDPA's slow GQA path on the CPU."""
    hq, hkv, d = q.shape[1], k_cache.shape[2], q.shape[2]
    bsz, bs, g = meta.num_seqs, k_cache.shape[1], hq // hkv
    max_len = meta.max_seq_len
    nb = (max_len + bs - 1) // bs
    tables = meta.block_tables[:, :nb].reshape(-1)  # [B * nb]
    k = k_cache.index_select(0, tables).view(bsz, nb * bs, hkv, d)  # [B, S, Hkv, D]
    v = v_cache.index_select(0, tables).view(bsz, nb * bs, hkv, d)
    if bsz == 1:  # nothing to mask: cut the padding off instead
        k, v = k[:, :max_len], v[:, :max_len]
    # Half-precision batched matmuls are slow on CPUs without native bf16/fp16 units: the
    # small attention products run in float32 there (the KV rows are few; the weights are not).
    work = torch.float32 if q.device.type == "cpu" else q.dtype
    k, v = k.to(work), v.to(work)
    qg = q.view(bsz, hkv, g, d).to(work)  # [B, Hkv, g, D]
    scores = torch.stack([torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) for h in range(hkv)],
                         dim=1).float() * scale  # [B, Hkv, g, S]
    if bsz > 1:
        pad = torch.arange(k.shape[1], device=q.device)[None, :] >= meta.seq_lens[:, None].to(
            q.device)  # [B, S]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(work)  # [B, Hkv, g, S]
    o = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(hkv)], dim=1)
    return o.reshape(bsz, hq, d).to(q.dtype)  # [B, Hkv, g, D] -> [B, Hq, D]


class TorchAttentionBackend:
    """The CPU/reference backend. A Triton backend offers the same two calls."""

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
