"""Verification attention with rotary and the KV write folded in: the few-row sibling of
`decode_attention.py`, one launch (plus a merge) per layer.

A verification step gives every sequence Q query rows (the last accepted token and Q - 1 draft
nodes; the graph runner pads each sequence to its bucket's Q). The general path costs two
launches per layer (rope_write_kv, then `paged_attention.py`, which walks a chain of dependent
loads: query starts, the owning sequence, its context, the block table, K, then V). Here:

- q and the new k, v arrive as the qkv matmul wrote them; every program first loads its query
  rows and their rotary factors (`fused_ops.rope_table`: cos and sin made once per step for
  every layer) and rotates q in registers. Computing the angles' cosines and sines in every
  program for all its rows cost 3.0 of 12.9 us per layer at 8 rows on the H200, Llama-3.1-8B
  heads, 1k context; with the table and the query rows loaded first the layer takes 9.75 us
  (bench/results/gpu_attn_parts_h200_20261201_before.json, _table.json);
- with NUM_SPLITS > 1, the cached columns [0, context) are spread over programs 1 to
  NUM_SPLITS - 1 per (sequence, KV head), each loading its context length, then block-table
  entries, then K and V together;
- program 0 (the owner) takes only the step's own Q columns, in parallel with them: it
  rotates their keys, writes keys and values to the cache at the step's slots, and scores them
  from registers under the sequence's [Q, Q] mask (causal when it has none). (With one split,
  the one program does both.) Giving it cached columns as well made it the last to finish:
  15.0 against 13.8 us per layer at 8 rows, 11.8 against 11.0 at 2 (16 splits,
  bench/results/gpu_tiles_h200_20261201.json). It is split 0 so that it is dispatched first:
  with 8 warps a program holds about a whole SM's registers (247 per thread at 8 rows, sm_90,
  Triton 3.6: bench/investigations/kernel_registers.py), so a grid with more programs than
  SMs runs in waves. Since the table its work is off the critical path (the layer takes as
  long with the owner idle). More splits with one KV tile each, 128-column tiles, or registers
  capped so that two programs share an SM were all slower
  (bench/results/gpu_tiles_h200_20261201_wide.json).

A program's BLOCK_M rows are Q query tokens times the GROUP query heads of its KV head (padded
to a power of two), so each K/V tile feeds every row. `row_blocks` R spreads them over R
programs that read the same tiles (R x the grid, each program with 1/R of the rows and their
registers). 32 rows a program did best: per layer at 8 rows, batch 1, 1k context, Qwen2.5-7B's
heads (7 a group: 64 rows) took 12.41 us in 2 blocks (9 splits) against 18.69 in one (17
splits, the best of one) and 14.51 in 4; Llama-3.1-8B's (4 a group: 32 rows) 12.91 in one
against 14.05 in 2 (bench/results/gpu_tiles_h200_20261201_rowblocks.json).

This is a separate kernel rather than a generalised decode kernel: folding Q > 1 into the
decode kernel made 1-row steps slower on the H200 (4.74 against 4.15 ms per Llama-3.1-8B step,
`bench/results/gpu_engine_h200_20261130_smallq.*`). Rounding follows the unfused path. The
reference is `decode_attention.decode_attention_ref`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specdec.attention_metadata import AttentionMetadata
from verify_kernels.attention_parts import (
    attend_cached,
    attend_tile,
    load_kv,
    rotate,
    softmax_start,
    store_empty,
    store_result,
)
from verify_kernels.decode_attention import supported
from verify_kernels.fused_ops import rope_table
from verify_kernels.paged_attention import merge_splits
from verify_kernels.pdl import interpreting

__all__ = ["MAX_Q", "MAX_SEQS", "fuses", "takes", "tree_attention"]

_LOG2E = 1.4426950408889634
# Steps the backend sends here (`fuses`): at most MAX_SEQS sequences of the same 2 to MAX_Q
# rows. On the H200 (Llama-3.1-8B heads, 1k context), per layer in a 32-layer graph of attention
# alone, best split count each, batch 1: 9.7 against 13.6 us for the launches it replaces at 2
# rows, 11.1 / 17.3 at 8, 14.4 / 21.9 at 16 (bench/results/gpu_tiles_h200_20261201_rows16.json).
# At 16 sequences the two launches stay faster: 44.8 against 50.1 us at 8 rows, 54.5 / 93.9 at
# 16 (gpu_tiles_b16_h200_20261201_rows16.json).
MAX_Q = 16
MAX_SEQS = 4
# A program holds a sequence's rows for every query head of a KV head (the group, padded to a
# power of two). Qwen2.5-7B's heads (7 a group) at 16 rows put 128 rows in a program: fused,
# its 16-row step took 5.25 ms (1.339 decode steps; Llama's, at 64 rows a program, 1.111) in
# gpu_engine_qwen_h200_20261201_b1.json, against 5.21 ms with the two launches at 2026-12-01
# morning's code (gpu_engine_h200_20261201_qwen_quick.json), whose 8-row step was 0.5 ms
# slower than now. Such steps take the two launches: 1.315 decode steps with this rule
# (gpu_engine_qwen_h200_20261201_long.json, another machine). The kernel itself has not been
# timed side by side on these heads at 16 rows (bench/investigations/gpu_tiles.py --part
# attention --shape qwen2.5-7b-shape).
MAX_PROGRAM_ROWS = 64
KERNEL_MAX_Q = 16
# Rows a program takes when a call names no row blocks (`tree_attention`): BLOCK_M rows in
# BLOCK_M / BLOCK_ROWS blocks (at least one).
BLOCK_ROWS = 32


@triton.jit
def _tree_attn_kernel(
    out_ptr,  # [T, Hq, D] q dtype, T = B * Q
    part_ptr,  # [T, Hq, NUM_SPLITS, D] float32 normalised partials (split only)
    lse_ptr,  # [T, Hq, NUM_SPLITS] float32 log2-sum-exp of each partial (split only)
    q_ptr,  # [T, Hq, D] unrotated
    k_ptr,  # [T, Hkv, D] unrotated, the step's new keys
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], blocks contiguous
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32, KV entries before the step
    rope_ptr,  # [T, 2, D] float32 rotary factors (fused_ops.rope_table)
    slot_ptr,  # [T] int64, negative = padding: nothing written
    mask_offsets_ptr,  # [B] int64, -1 = causal
    custom_mask_ptr,  # [M] uint8, per sequence a [Q, Q] visibility matrix (HAS_MASK only)
    q_len, scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh_new, stride_vt, stride_vh_new,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_M: tl.constexpr, NEW_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_MASK: tl.constexpr,
    ROW_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2) // ROW_BLOCKS  # row blocks of one split are neighbours
    rb = tl.program_id(2) % ROW_BLOCKS
    HALF: tl.constexpr = HEAD_DIM // 2
    m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // GROUP_P  # the row's query token within the sequence
    row_ok = (m % GROUP_P < GROUP) & (t < q_len)
    tok = b * q_len + t
    head = kvh * GROUP + m % GROUP_P
    d = tl.arange(0, HEAD_DIM)
    dp = (d + HALF) % HEAD_DIM
    owner = split == 0  # takes the step's own columns
    # The query rows and their rotary factors load before the context length and the block
    # table that the cached columns wait on. The owner's own loads come later: issued here too,
    # their registers spilled (per layer at 8 rows on the H200, 13.28 us against 9.75;
    # bench/results/gpu_attn_parts_h200_20261201_spill.json and _table.json).
    q_rows = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    qa = tl.load(q_rows + d[None, :], mask=row_ok[:, None], other=0.0)
    qb = tl.load(q_rows + dp[None, :], mask=row_ok[:, None], other=0.0)
    r_rows = rope_ptr + tok[:, None] * (2 * HEAD_DIM) + d[None, :]
    cos = tl.load(r_rows, mask=row_ok[:, None], other=0.0)
    sin = tl.load(r_rows + HEAD_DIM, mask=row_ok[:, None], other=0.0)
    ctx = tl.load(context_lens_ptr + b)

    lo = 0
    hi = ctx
    if NUM_SPLITS > 1:
        per = tl.cdiv(tl.cdiv(ctx, BLOCK_N), NUM_SPLITS - 1) * BLOCK_N  # the owner: none
        lo = (split - 1) * per
        hi = tl.minimum(lo + per, ctx)
        if owner:
            lo = 0
            hi = 0
    idle = (lo >= hi) & (split != 0)
    bt_row = block_tables_ptr + b * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    k, v, col_ok = load_kv(lo + tl.arange(0, BLOCK_N), hi, bt_row, k_base, v_base, d,
                           stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_SIZE)
    p_off = tok * stride_pt + head * stride_ph
    l_off = tok * stride_lt + head * stride_lh
    if idle:  # past the context, not the owner: an empty partial (the merge reads L2)
        store_empty(part_ptr, lse_ptr, p_off, l_off, d, row_ok, split, stride_ps, BLOCK_M,
                    HEAD_DIM)
    else:
        q = rotate(qa, qb, cos, sin).to(qa.dtype)  # [BLOCK_M, D]
        if lo < hi:
            m_i, l_i, acc = attend_cached(q, k, v, col_ok, lo, hi, bt_row, k_base, v_base, d,
                                          stride_kb, stride_ks, stride_vb, stride_vs,
                                          scale_log2, BLOCK_M, HEAD_DIM, BLOCK_N, BLOCK_SIZE,
                                          DOT_PRECISION)
        else:
            m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
        if owner:  # the step's own columns: rotate k, write k and v, score them
            j = tl.arange(0, NEW_P)
            j_ok = j < q_len
            jtok = b * q_len + j
            k_rows = k_ptr + jtok[:, None] * stride_kt + kvh * stride_kh_new
            j_rows = rope_ptr + jtok[:, None] * (2 * HEAD_DIM) + d[None, :]
            kr = rotate(tl.load(k_rows + d[None, :], mask=j_ok[:, None], other=0.0),
                        tl.load(k_rows + dp[None, :], mask=j_ok[:, None], other=0.0),
                        tl.load(j_rows, mask=j_ok[:, None], other=0.0),
                        tl.load(j_rows + HEAD_DIM, mask=j_ok[:, None], other=0.0),
                        ).to(q.dtype)  # [NEW_P, D]
            vn = tl.load(v_ptr + jtok[:, None] * stride_vt + kvh * stride_vh_new + d[None, :],
                         mask=j_ok[:, None], other=0.0)  # [NEW_P, D]
            slot = tl.load(slot_ptr + jtok, mask=j_ok, other=-1)
            # Every row block scores the new columns; the first writes them (rb as a row-shaped
            # value, as the interpreter needs).
            put = ((slot >= 0) & ((j * 0 + rb) == 0))[:, None]
            # Slots index blocks x in-block positions (blocks contiguous, checked on launch).
            tl.store(k_base + slot[:, None] * stride_ks + d[None, :],
                     kr.to(k_cache_ptr.dtype.element_ty), mask=put)
            tl.store(v_base + slot[:, None] * stride_vs + d[None, :],
                     vn.to(v_cache_ptr.dtype.element_ty), mask=put)
            vis = j[None, :] <= t[:, None]  # causal
            if HAS_MASK:
                base = tl.load(mask_offsets_ptr + b)
                custom = (j * 0 + base) >= 0  # a row-shaped scalar (as the interpreter needs)
                bits = tl.load(custom_mask_ptr + base + t[:, None] * q_len + j[None, :],
                               mask=row_ok[:, None] & j_ok[None, :] & custom[None, :], other=0)
                vis = tl.where(custom[None, :], bits != 0, vis)
            m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, tl.trans(kr), vn, vis & j_ok[None, :],
                                        scale_log2, DOT_PRECISION)
        store_result(acc, m_i, l_i, out_ptr, part_ptr, lse_ptr,
                     tok * stride_ot + head * stride_oh, p_off, l_off, d, row_ok, split,
                     stride_ps, NUM_SPLITS)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _register_cap(max_registers: int | None, device: torch.device) -> dict:
    """Launch keyword arguments capping registers per thread (none on the CPU)."""
    if max_registers is None or device.type != "cuda" or interpreting():
        return {}
    return {"maxnreg": max_registers}


def takes(batch: int, rows: int, group: int = 1) -> bool:
    """Whether the fused path takes `batch` sequences of `rows` rows each, for `group` query
    heads per KV head: at most MAX_SEQS sequences of 2 to MAX_Q rows, at most
    MAX_PROGRAM_ROWS rows a program (where it measured faster than the two launches)."""
    return (batch <= MAX_SEQS and 2 <= rows <= MAX_Q
            and rows * _next_pow2(group) <= MAX_PROGRAM_ROWS)


def fuses(meta: AttentionMetadata, group: int = 1) -> bool:
    """`takes` for a step, whose sequences must all have the same number of rows."""
    return takes(len(meta.q_lens_host), _rows(meta), group)


def _rows(meta: AttentionMetadata) -> int:
    """Rows per sequence if every sequence has the same number, else 0."""
    qs = meta.q_lens_host
    return qs[0] if qs and all(x == qs[0] for x in qs) else 0


def tree_attention(
    q: torch.Tensor,  # [T, Hq, D] unrotated, T = B * Q
    k: torch.Tensor,  # [T, Hkv, D] unrotated
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D / 2] float32
    rope_scaling: float,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,  # Q rows per sequence, each causal or with a [Q, Q] mask
    scale: float | None = None,
    num_splits: int = 1,
    num_warps: int | None = None,
    block_n: int | None = None,
    row_blocks: int | None = None,
    max_registers: int | None = None,
    rope: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype
    """Rotary on q and k, k and v into the cache at `meta.slot_mapping`, and attention of each
    sequence's Q rows over its context and the rows it sees. Reads nothing from the device on
    the host: `num_splits` is the caller's (a graph fixes it per bucket). `num_warps` None
    takes 8 (faster than 4 on the H200 at every row count and split count at batch 1);
    `block_n` (KV columns per tile, a power of two >= 16) None takes 64 up to head dim 128.
    `row_blocks` R splits a program's rows (Q tokens x the KV head's query heads) over R
    programs of at least 16 rows each, which read the same KV tiles: fewer registers per
    program, so more programs per SM (at 8 rows a program of 32 rows holds about an SM's).
    None takes as many as leave each block BLOCK_ROWS rows (at least one). `max_registers`
    caps registers per thread (ptxas spills the rest), so that more programs share an SM: for
    timing only, slower at every cap timed on the H200.
    `rope`: the step's `fused_ops.rope_table(positions, inv_freq, rope_scaling)`, made once
    for all layers (None: made here)."""
    t, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    bsz = meta.num_seqs
    assert 2 <= _rows(meta) <= KERNEL_MAX_Q, (
        f"rows per sequence {meta.q_lens_host[:5]}: uniform, 2 to {KERNEL_MAX_Q}")
    ql = meta.q_lens_host[0]
    assert t == bsz * ql, "q rows != sequences x rows"
    assert k.shape == (t, hkv, d) and v.shape == (t, hkv, d), "q, k, v shapes"
    assert dk == d and hq % hkv == 0 and bs == meta.block_size and v_cache.shape == k_cache.shape
    assert supported(q, inv_freq) and inv_freq.dtype == torch.float32
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(0) == bs * k_cache.stride(1), "slots must be contiguous"
    assert positions.shape == (t,) and positions.dtype == torch.int64
    if rope is None:
        rope = rope_table(positions, inv_freq, rope_scaling)
    assert rope.shape == (t, 2, d) and rope.dtype == torch.float32 and rope.is_contiguous()
    assert meta.slot_mapping.shape == (t,) and meta.slot_mapping.dtype == torch.int64
    assert meta.context_lens.dtype == torch.int32 and meta.block_tables.dtype == torch.int32
    assert meta.mask_offsets.dtype == torch.int64
    assert meta.block_tables.stride(1) == 1 and num_splits >= 1
    assert block_n is None or (block_n >= 16 and block_n & (block_n - 1) == 0), block_n
    has_mask = any(o >= 0 for o in meta.mask_offsets_host)
    if has_mask:
        assert meta.custom_mask is not None and meta.custom_mask.dtype == torch.bool
    dev = q.device
    out = torch.empty((t, hq, d), dtype=q.dtype, device=dev)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    group = hq // hkv
    group_p, q_p = _next_pow2(group), _next_pow2(ql)
    block_m = max(16, q_p * group_p)
    if row_blocks is None:
        row_blocks = max(1, block_m // BLOCK_ROWS)
    assert row_blocks >= 1 and block_m % row_blocks == 0 and block_m // row_blocks >= 16, (
        f"{row_blocks} row blocks of {block_m} rows: each needs 16 or more")
    splits = num_splits
    part = torch.empty((t, hq, splits, d), dtype=torch.float32, device=dev) if splits > 1 else out
    lse = torch.empty((t, hq, splits), dtype=torch.float32, device=dev) if splits > 1 else out
    ps = (hq * splits * d, splits * d, d) if splits > 1 else (0, 0, 0)
    ls = (hq * splits, splits) if splits > 1 else (0, 0)
    mask = (meta.custom_mask if has_mask else meta.mask_offsets).view(torch.uint8)
    _tree_attn_kernel[(bsz, hkv, splits * row_blocks)](
        out, part, lse, q, k, v, k_cache, v_cache, meta.block_tables, meta.context_lens,
        rope, meta.slot_mapping, meta.mask_offsets, mask, ql, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), *ps, *ls,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        HEAD_DIM=d, GROUP=group, GROUP_P=group_p, BLOCK_M=block_m // row_blocks,
        NEW_P=max(16, q_p),
        BLOCK_N=block_n or (64 if d <= 128 else 32), BLOCK_SIZE=bs, NUM_SPLITS=splits,
        HAS_MASK=has_mask, ROW_BLOCKS=row_blocks,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=num_warps or 8, **_register_cap(max_registers, dev),
    )
    if splits > 1:
        merge_splits(out, part, lse)
    return out
