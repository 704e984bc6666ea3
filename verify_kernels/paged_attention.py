"""Paged attention over a ragged batch of prefill chunks, decode tokens and draft-tree nodes.

One kernel serves every kind of query row (`specdec.attention_metadata` is the contract).
A program owns a tile of BLOCK_Q query tokens of one sequence times the GROUP query heads that
share one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP_P rows, so each K/V tile read through
the block table feeds every query head of the group. Tiles are numbered without a host-built
table: sequence b's tiles start at `query_start[b] // BLOCK_Q + b`, and a program finds its
sequence by binary search over `query_start`, so the grid is `T // BLOCK_Q + B` from host ints.

The KV range of a tile is walked in two loops: first the columns every row of the tile sees
(the paged prefix, and for causal rows the earlier rows of the step) with no masking at all, then
the rest with the causal or custom (tree) mask. The split-KV variant (flash decoding) partitions
the same range over NUM_SPLITS programs, each writing a normalised partial output and its
log-sum-exp; `_reduce_kernel` merges them. The reference is `reference.paged_attention_ref`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.attention_metadata import AttentionMetadata
from verify_kernels.reference import paged_attention_ref

__all__ = ["choose_num_splits", "merge_splits", "paged_attention", "paged_attention_ref"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start[b] // BLOCK_Q + b <= tile (the owner of `tile`)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attn_tile(
    q, m_i, l_i, acc, cols, tok, row_ok, ctx, q_len, hi, mask_base,
    k_base, v_base, bt_row_ptr, custom_mask_ptr, d, scale_log2,
    stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the KV columns `cols` ([BLOCK_N] kv indices)."""
    d_ok = d < HEAD_DIM
    if MASKED:
        col_ok = cols < hi
    else:
        col_ok = cols >= 0
    page = tl.load(bt_row_ptr + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
    in_page = (cols % BLOCK_SIZE).to(tl.int64)
    kv_mask = col_ok[None, :] & d_ok[:, None]
    k = tl.load(k_base + page[None, :] * stride_kb + in_page[None, :] * stride_ks + d[:, None],
                mask=kv_mask, other=0.0)  # [D, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if MASKED:
        rel = cols - ctx  # column index among the step's rows, < 0 for the paged prefix
        vis = rel[None, :] <= tok[:, None]
        if HAS_MASK:
            tree_ok = row_ok[:, None] & (rel[None, :] >= 0) & col_ok[None, :]
            # A scalar predicate broadcast as a row: the interpreter widens scalar bools.
            is_tree = (rel * 0 + mask_base) >= 0  # [BLOCK_N]
            tree_ok = tree_ok & is_tree[None, :]
            bits = tl.load(custom_mask_ptr + mask_base + tok[:, None] * q_len + rel[None, :],
                           mask=tree_ok, other=0)
            vis = tl.where(is_tree[None, :], (bits != 0) | (rel[None, :] < 0), vis)
        vis = vis & col_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + page[:, None] * stride_vb + in_page[:, None] * stride_vs + d[None, :],
                mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attn_kernel(
    out_ptr,  # [T, Hq, D] q dtype, or [T, Hq, NUM_SPLITS, D] float32 partials when split
    lse_ptr,  # [T, Hq, NUM_SPLITS] float32 log2-sum-exp of each partial (split only)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    mask_offsets_ptr,  # [B] int64, -1 = causal
    custom_mask_ptr,  # [M] uint8
    num_seqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_MASK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = _find_seq(query_start_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    q0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q0 < q_len:
        ctx = tl.load(context_lens_ptr + b)
        custom = False
        mask_base = 0
        if HAS_MASK:
            mask_base = tl.load(mask_offsets_ptr + b)
            custom = mask_base >= 0
        m = tl.arange(0, BLOCK_M)
        tok = q0 + m // GROUP_P  # [BLOCK_M] query row within the sequence's step
        head = kvh * GROUP + m % GROUP_P
        row_ok = (tok < q_len) & (m % GROUP_P < GROUP)
        d = tl.arange(0, HEAD_DIM_P)
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :], mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)

        last = tl.minimum(q0 + BLOCK_Q, q_len)  # one past the tile's last row
        kv_end = ctx + last
        seen_by_all = ctx + q0  # causal: rows q0.. all see the prefix and rows < q0
        if custom:
            kv_end = ctx + q_len
            seen_by_all = ctx
        full_end = (seen_by_all // BLOCK_N) * BLOCK_N
        lo = 0
        hi = kv_end
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS) * BLOCK_N
            lo = split * per
            hi = tl.minimum(lo + per, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
        k_base = k_cache_ptr + kvh * stride_kh
        v_base = v_cache_ptr + kvh * stride_vh
        bt_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, tl.minimum(hi, full_end), BLOCK_N):
            m_i, l_i, acc = _attn_tile(
                q, m_i, l_i, acc, start + n, tok, row_ok, ctx, q_len, hi, mask_base,
                k_base, v_base, bt_row_ptr, custom_mask_ptr, d, scale_log2,
                stride_kb, stride_ks, stride_vb, stride_vs,
                HEAD_DIM, BLOCK_SIZE, False, HAS_MASK, DOT_PRECISION)
        for start in range(tl.maximum(lo, full_end), hi, BLOCK_N):
            m_i, l_i, acc = _attn_tile(
                q, m_i, l_i, acc, start + n, tok, row_ok, ctx, q_len, hi, mask_base,
                k_base, v_base, bt_row_ptr, custom_mask_ptr, d, scale_log2,
                stride_kb, stride_ks, stride_vb, stride_vs,
                HEAD_DIM, BLOCK_SIZE, True, HAS_MASK, DOT_PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        out_rows = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        o_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
        if NUM_SPLITS > 1:
            tl.store(out_ptr + out_rows + split * stride_os + d[None, :], o, mask=o_mask)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            lse_idx = (q_start + tok).to(tl.int64) * stride_lt + head * stride_lh + split
            tl.store(lse_ptr + lse_idx, lse, mask=row_ok)
        else:
            tl.store(out_ptr + out_rows + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _reduce_kernel(
    out_ptr,  # [T, Hq, D]
    part_ptr,  # [T, Hq, NUM_SPLITS, D] float32
    lse_ptr,  # [T, Hq, NUM_SPLITS] float32
    num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # token
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    base = row * num_heads + h
    lse = tl.load(lse_ptr + base * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # [SPLITS_P]
    part = tl.load(part_ptr + (base * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
                   mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tiling(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a tile, and query tokens per tile (BLOCK_M // GROUP_P)."""
    group_p = _next_pow2(num_q_heads // num_kv_heads)
    block_m = max(16, group_p, min(64, _next_pow2(meta.max_q_len * group_p)))
    return block_m, block_m // group_p


def choose_num_splits(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int,
                      device: torch.device) -> int:
    """KV partitions per tile: >1 only when too few tiles face long contexts to fill the GPU."""
    num_tokens = sum(meta.q_lens_host)
    if device.type != "cuda" or meta.max_seq_len < 512 or num_tokens > 1024:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    _, block_q = _tiling(meta, num_q_heads, num_kv_heads)
    programs = (num_tokens // block_q + meta.num_seqs) * num_kv_heads  # the grid, upper bound
    if programs >= sms:
        return 1
    # One KV tile per split where the GPU has room: at batch 1 a split walking several tiles
    # is a chain of dependent loads, and its latency, not bandwidth, sets the kernel's time.
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(meta.max_seq_len, 64), 32))


@dataclass(frozen=True)
class _Plan:
    """What the launch needs from the metadata, checked and derived once per step: every layer
    of a step shares one AttentionMetadata, so the host work is not repeated per layer."""

    num_tokens: int
    block_m: int
    block_q: int
    splits: int  # the heuristic's choice
    has_mask: bool
    mask: torch.Tensor  # [M] uint8 view of custom_mask (any uint8 tensor when unused)


_PLANS: dict[tuple[int, int, int], tuple[AttentionMetadata, _Plan]] = {}


def _plan(meta: AttentionMetadata, num_q_heads: int, num_kv_heads: int,
          device: torch.device) -> _Plan:
    key = (id(meta), num_q_heads, num_kv_heads)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is meta:  # the cache holds meta, so its id stays unique
        return hit[1]
    b = meta.num_seqs
    assert meta.block_tables.device == device, "metadata and q on different devices"
    assert meta.query_start.shape == (b + 1,) and meta.query_start.dtype == torch.int32
    assert meta.context_lens.shape == (b,) and meta.context_lens.dtype == torch.int32
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == b
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
    assert meta.mask_offsets.shape == (b,) and meta.mask_offsets.dtype == torch.int64
    assert meta.max_seq_len <= meta.block_tables.shape[1] * meta.block_size, "block table short"
    has_mask = any(o >= 0 for o in meta.mask_offsets_host)
    if has_mask:
        assert meta.custom_mask is not None and meta.custom_mask.dtype == torch.bool
    block_m, block_q = _tiling(meta, num_q_heads, num_kv_heads)
    plan = _Plan(
        num_tokens=sum(meta.q_lens_host), block_m=block_m, block_q=block_q,
        splits=choose_num_splits(meta, num_q_heads, num_kv_heads, device), has_mask=has_mask,
        mask=(meta.custom_mask if has_mask else meta.mask_offsets).view(torch.uint8),
    )
    if len(_PLANS) >= 16:
        _PLANS.clear()
    _PLANS[key] = (meta, plan)
    return plan


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Attention of every query row of the step; `num_splits` None picks split-KV itself."""
    t, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape  # unpacking also checks the ranks
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert dk == d and hq % hkv == 0 and bs == meta.block_size, "q/cache shapes or block size"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), q.dtype
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    dev = q.device
    assert k_cache.device == dev and v_cache.device == dev
    plan = _plan(meta, hq, hkv, dev)
    assert plan.num_tokens == t, "q rows != sum of q_lens_host"
    out = torch.empty((t, hq, d), dtype=q.dtype, device=dev)
    if t == 0:
        return out
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    splits = num_splits if num_splits is not None else plan.splits
    assert splits >= 1
    grid = (t // plan.block_q + meta.num_seqs, hkv, splits)
    if splits > 1:
        part = torch.empty((t, hq, splits, d), dtype=torch.float32, device=dev)
        lse = torch.empty((t, hq, splits), dtype=torch.float32, device=dev)
        dst, so, ls = part, (hq * splits * d, splits * d, d), (hq * splits, splits)
    else:
        lse = out  # unused
        dst, so, ls = out, (hq * d, d, 0), (0, 0)
    head_dim_p = max(16, _next_pow2(d))
    _paged_attn_kernel[grid](
        dst, lse, q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.context_lens,
        meta.mask_offsets, plan.mask, meta.num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), *so, *ls,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        HEAD_DIM=d, HEAD_DIM_P=head_dim_p, GROUP=hq // hkv,
        GROUP_P=plan.block_m // plan.block_q, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
        BLOCK_N=64 if d <= 128 else 32, BLOCK_SIZE=bs, HAS_MASK=plan.has_mask,
        NUM_SPLITS=splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=4,
    )
    if splits > 1:
        merge_splits(out, part, lse)
    return out


def merge_splits(
    out: torch.Tensor,  # [T, Hq, D], written
    part: torch.Tensor,  # [T, Hq, S, D] float32, each split's normalised partial
    lse: torch.Tensor,  # [T, Hq, S] float32, its log2-sum-exp (-inf: an empty split)
) -> None:
    """Combine split-KV partials by log-sum-exp (also used by decode_attention.py)."""
    t, hq, splits, d = part.shape
    assert out.shape == (t, hq, d) and out.is_contiguous() and part.is_contiguous()
    assert lse.shape == (t, hq, splits) and lse.is_contiguous()
    _reduce_kernel[(t, hq)](
        out, part, lse, hq, hq * d, d,
        HEAD_DIM=d, HEAD_DIM_P=max(16, _next_pow2(d)), NUM_SPLITS=splits,
        SPLITS_P=_next_pow2(splits), num_warps=4,
    )
