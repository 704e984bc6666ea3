"""The device functions the decode and tree attention kernels share (decode_attention.py,
tree_attention.py): rotary in registers, K and V tiles through the block table, online-softmax
steps over a loaded tile and over a range of cached columns, and the stores of a program's
result or of its split's partial for `paged_attention.merge_splits`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["attend_cached", "attend_tile", "load_kv", "rotate", "softmax_start", "store_empty",
           "store_result"]


@triton.jit
def rotate(x, xp, cos, sign_sin):
    """x * cos + rotate_half(x) * sin, where xp is x read at (d + HALF) % D."""
    return x.to(tl.float32) * cos + xp.to(tl.float32) * sign_sin


@triton.jit
def load_kv(cols, hi, bt_row, k_base, v_base, d, stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_SIZE: tl.constexpr):
    """K [D, BLOCK_N] and V [BLOCK_N, D] of cached columns `cols` below `hi`, through the
    block table: both loads depend only on the page, so both are in flight together."""
    col_ok = cols < hi
    page = tl.load(bt_row + cols // BLOCK_SIZE, mask=col_ok, other=0).to(tl.int64)
    in_page = (cols % BLOCK_SIZE).to(tl.int64)
    k = tl.load(k_base + page[None, :] * stride_kb + in_page[None, :] * stride_ks + d[:, None],
                mask=col_ok[None, :], other=0.0)
    v = tl.load(v_base + page[:, None] * stride_vb + in_page[:, None] * stride_vs + d[None, :],
                mask=col_ok[:, None], other=0.0)
    return k, v, col_ok


@triton.jit
def attend_tile(q, m_i, l_i, acc, k, v, vis, scale_log2, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of q [BLOCK_M, D] over a loaded tile, K [D, N] and V [N, D], of
    which `vis` ([BLOCK_M, N] or [1, N]) says what each row sees."""
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(vis, s, float("-inf"))  # [BLOCK_M, N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(running max, running sum, accumulator) before any column."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))


@triton.jit
def attend_cached(q, k, v, col_ok, lo, hi, bt_row, k_base, v_base, d, stride_kb, stride_ks,
                  stride_vb, stride_vs, scale_log2, BLOCK_M: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online softmax of q over the cached columns [lo, hi), whose first tile (k, v, col_ok)
    the caller has loaded; each later tile's K and V load together, a tile ahead."""
    m_i, l_i, acc = softmax_start(BLOCK_M, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    # The next tile's loads are in flight while this tile's products run: per layer at batch 1
    # on the H200, decode 7.7 against 9.1 us, 8-row trees 13.1 against 13.8
    # (bench/results/gpu_tiles_h200_20261201_prefetch.json).
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        k2, v2, ok2 = load_kv(start + n, hi, bt_row, k_base, v_base, d, stride_kb, stride_ks,
                              stride_vb, stride_vs, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k, v, col_ok[None, :], scale_log2,
                                    DOT_PRECISION)
        k, v, col_ok = k2, v2, ok2
    m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, k, v, col_ok[None, :], scale_log2,
                                DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def store_result(acc, m_i, l_i, out_ptr, part_ptr, lse_ptr, o_off, p_off, l_off, d, row_ok,
                 split, stride_ps, NUM_SPLITS: tl.constexpr):
    """The normalised output of rows at offsets o_off ([BLOCK_M]); with splits, this split's
    partial (at p_off) and its log2-sum-exp (at l_off) for the merge."""
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS > 1:
        tl.store(part_ptr + p_off[:, None] + split * stride_ps + d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(lse_ptr + l_off + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def store_empty(part_ptr, lse_ptr, p_off, l_off, d, row_ok, split, stride_ps,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """An empty partial (a split past the context), so that the merge reads nothing stale."""
    tl.store(part_ptr + p_off[:, None] + split * stride_ps + d[None, :],
             tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=row_ok[:, None])
    tl.store(lse_ptr + l_off + split, tl.full([BLOCK_M], float("-inf"), tl.float32),
             mask=row_ok)
