"""Decode attention with rotary and the KV write folded in: one launch (plus a merge) per layer.

For a step where every sequence has one query row (plain decoding), the general kernel
(`paged_attention.py`) is preceded by a rotary + KV-write launch and walks a chain of dependent
loads (query starts, the owning sequence, its context, the block table, K, then V). At batch 1
nothing here is bandwidth-bound: a layer's 4 MB of KV at 1k tokens is a microsecond of reading,
so launches and load latency set the time. This kernel shortens both:

- q and the new k arrive unrotated (straight from the qkv matmul); each program rotates q in
  registers, and the one program whose KV range holds the new column rotates k, writes k and v
  to the cache at the step's slot, and scores that column from registers;
- a program's loads are its context length, then block-table entries, then K and V together.

Split-KV (flash decoding) spreads a sequence's KV over NUM_SPLITS programs per KV head; only the
splits the context reaches do work (the others write an empty partial, so that the merge reads
nothing stale), and `paged_attention.merge_splits` combines the partials by log-sum-exp. Measured
slower on the H200 and not kept: folding the merge into the last split to finish, by an atomic
count (11.5 against 8.9 us per layer at batch 1); asking L2 for the o_proj weight during
attention (step 1.5% slower: the attention's own loads wait behind it). Rounding follows the
unfused path: rotated q and k are rounded to the model dtype before the products. The reference is
`decode_attention_ref` (rotary and KV write, then `reference.paged_attention_ref`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specdec.attention_metadata import AttentionMetadata
from verify_kernels.attention_parts import (
    attend_cached,
    load_kv,
    rotate,
    store_empty,
    store_result,
)
from verify_kernels.paged_attention import merge_splits
from verify_kernels.pdl import pdl_args, pdl_wait_release
from verify_kernels.reference import paged_attention_ref, write_kv_ref

__all__ = ["decode_attention", "decode_attention_ref"]

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attn_kernel(
    out_ptr,  # [B, Hq, D] q dtype
    part_ptr,  # [B, Hq, NUM_SPLITS, D] float32 normalised partials (split only)
    lse_ptr,  # [B, Hq, NUM_SPLITS] float32 log2-sum-exp of each partial (split only)
    q_ptr,  # [B, Hq, D] unrotated
    k_ptr,  # [B, Hkv, D] unrotated, the step's new keys
    v_ptr,  # [B, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32, KV entries before the step (the new column's index)
    pos_ptr,  # [B] int64
    slot_ptr,  # [B] int64, negative = padding: nothing written
    inv_ptr,  # [D / 2] float32 inverse frequencies
    scale_log2, rope_scaling,
    stride_qb, stride_qh, stride_kb_new, stride_kh_new, stride_vb_new, stride_vh_new,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    m = tl.arange(0, BLOCK_M)
    row_ok = m < GROUP
    head = kvh * GROUP + m
    d = tl.arange(0, HEAD_DIM)
    dp = (d + HALF) % HEAD_DIM
    ctx = tl.load(context_lens_ptr + b)
    freq = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_ptr + d % HALF)
    cos = tl.cos(freq) * rope_scaling
    sign_sin = tl.where(d < HALF, -1.0, 1.0) * tl.sin(freq) * rope_scaling

    n_all = ctx + 1  # the cached columns and the new one
    lo = 0
    hi = n_all
    if NUM_SPLITS > 1:
        per = tl.cdiv(tl.cdiv(n_all, BLOCK_N), NUM_SPLITS) * BLOCK_N
        lo = split * per
        hi = tl.minimum(lo + per, n_all)
    cache_hi = tl.minimum(hi, ctx)
    bt_row = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    # The first tile's cached columns were written by earlier steps: under PDL they load while
    # the qkv matmul before this kernel finishes (verify_kernels/pdl.py); q, k, v come after.
    k, v, col_ok = load_kv(lo + tl.arange(0, BLOCK_N), cache_hi, bt_row, k_base, v_base, d,
                           stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_SIZE)
    pdl_wait_release(USE_PDL)
    q_rows = q_ptr + b * stride_qb + head[:, None] * stride_qh
    qa = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
    qb = tl.load(q_rows + dp[None, :], mask=row_ok[:, None], other=0.0)
    q = rotate(qa, qb, cos[None, :], sign_sin[None, :]).to(qa.dtype)  # [BLOCK_M, D]
    p_off = b * stride_pb + head * stride_ph
    l_off = b * stride_lb + head * stride_lh
    if lo >= hi:  # a split past the context: an empty partial, so the merge reads only L2
        if NUM_SPLITS > 1:
            store_empty(part_ptr, lse_ptr, p_off, l_off, d, row_ok, split, stride_ps, BLOCK_M,
                        HEAD_DIM)
    else:
        m_i, l_i, acc = attend_cached(q, k, v, col_ok, lo, cache_hi, bt_row, k_base, v_base, d,
                                      stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
                                      BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PRECISION)
        if ctx < hi:  # this program holds the new column: rotate k, write k and v, score it
            k_row = k_ptr + b * stride_kb_new + kvh * stride_kh_new
            kr = rotate(tl.load(k_row + d), tl.load(k_row + dp), cos, sign_sin)
            kr = kr.to(q.dtype)  # [D], rounded as the cache stores it
            v_new = tl.load(v_ptr + b * stride_vb_new + kvh * stride_vh_new + d)  # [D]
            slot = tl.load(slot_ptr + b)
            if slot >= 0:
                page = tl.load(bt_row + ctx // BLOCK_SIZE).to(tl.int64)
                in_page = ctx % BLOCK_SIZE
                tl.store(k_base + page * stride_kb + in_page * stride_ks + d,
                         kr.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_base + page * stride_vb + in_page * stride_vs + d,
                         v_new.to(v_cache_ptr.dtype.element_ty))
            s_new = tl.sum(q.to(tl.float32) * kr.to(tl.float32)[None, :], 1) * scale_log2
            m_new = tl.maximum(m_i, s_new)  # finite: every row sees its own column
            p_new = tl.math.exp2(s_new - m_new)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + p_new
            v_new = v_new.to(q.dtype).to(tl.float32)
            acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :]
            m_i = m_new
        store_result(acc, m_i, l_i, out_ptr, part_ptr, lse_ptr, b * stride_ob + head * stride_oh,
                     p_off, l_off, d, row_ok, split, stride_ps, NUM_SPLITS)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def block_n_for(head_dim: int, num_splits: int) -> int:
    """KV columns per tile. Measured on the H200 (Llama-3.1-8B heads, 1k context, per layer in
    a 32-layer graph): 32 columns and 32 splits 8.98 us at batch 1 against 9.79 with 64, 16
    splits at batch 4 12.96 against 14.28 for 64 columns' best; with few splits (long ranges
    per program) 64 columns win, up to 1.4x at one split."""
    return 32 if num_splits >= 16 or head_dim > 128 else 64


def supported(q: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """Head dims that are powers of two with a full rotary (the kernel's layout)."""
    d = q.shape[-1]
    return d >= 16 and d & (d - 1) == 0 and inv_freq.shape == (d // 2,)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D] unrotated
    k: torch.Tensor,  # [B, Hkv, D] unrotated
    v: torch.Tensor,  # [B, Hkv, D]
    positions: torch.Tensor,  # [B] int64
    inv_freq: torch.Tensor,  # [D / 2] float32
    rope_scaling: float,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,  # one query row per sequence
    scale: float | None = None,
    num_splits: int = 1,
    block_n: int | None = None,
    num_warps: int = 4,
    pdl: bool = False,  # programmatic dependent launch (pdl.py)
) -> torch.Tensor:  # [B, Hq, D] in q's dtype
    """Rotary on q and k, k and v into the cache at `meta.slot_mapping`, and attention of each
    sequence's one query row over its context and itself. Reads nothing from the device on
    the host: `num_splits` is the caller's (a graph fixes it per bucket). `block_n` (KV columns
    per tile, a power of two >= 16) and `num_warps` are there to be timed
    (bench/gpu_decode_attn.py; None: `block_n_for`). With 4 warps and 64-column tiles the
    kernel compiles to 255 registers and spills for head dim 128 (sm_90, Triton 3.9); 8 warps
    do not, but measured slower on the H200 at every split count, the spill notwithstanding."""
    bsz, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    assert meta.num_seqs == bsz and all(x == 1 for x in meta.q_lens_host), "one row per sequence"
    assert k.shape == (bsz, hkv, d) and v.shape == (bsz, hkv, d), "q, k, v shapes"
    assert dk == d and hq % hkv == 0 and bs == meta.block_size and v_cache.shape == k_cache.shape
    assert supported(q, inv_freq) and inv_freq.dtype == torch.float32
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert positions.shape == (bsz,) and positions.dtype == torch.int64
    assert meta.slot_mapping.shape == (bsz,) and meta.slot_mapping.dtype == torch.int64
    assert meta.context_lens.dtype == torch.int32 and meta.block_tables.dtype == torch.int32
    assert meta.block_tables.stride(1) == 1 and num_splits >= 1
    dev = q.device
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=dev)
    if bsz == 0:
        return out
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    group = hq // hkv
    block_n = block_n or block_n_for(d, num_splits)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    splits = num_splits
    part = torch.empty((bsz, hq, splits, d), dtype=torch.float32, device=dev) if splits > 1 else out
    lse = torch.empty((bsz, hq, splits), dtype=torch.float32, device=dev) if splits > 1 else out
    ps = (hq * splits * d, splits * d, d) if splits > 1 else (0, 0, 0)
    ls = (hq * splits, splits) if splits > 1 else (0, 0)
    _decode_attn_kernel[(bsz, hkv, splits)](
        out, part, lse, q, k, v, k_cache, v_cache, meta.block_tables, meta.context_lens,
        positions, meta.slot_mapping, inv_freq, scale * _LOG2E, rope_scaling,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *ps, *ls,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        HEAD_DIM=d, GROUP=group, BLOCK_M=max(16, _next_pow2(group)), BLOCK_N=block_n,
        BLOCK_SIZE=bs, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps,
        **pdl_args(dev, pdl),
    )
    if splits > 1:
        merge_splits(out, part, lse)
    return out


def decode_attention_ref(q, k, v, positions, inv_freq, rope_scaling, k_cache, v_cache, meta,
                         scale=None):
    from verify_kernels.fused_ops import rope_ref

    qr = rope_ref(q, positions, inv_freq, rope_scaling)
    kr = rope_ref(k, positions, inv_freq, rope_scaling)
    keep = meta.slot_mapping >= 0
    write_kv_ref(kr[keep], v[keep], k_cache, v_cache, meta.slot_mapping[keep])
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return paged_attention_ref(qr, k_cache, v_cache, meta, scale)
