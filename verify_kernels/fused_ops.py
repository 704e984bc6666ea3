"""Fused elementwise kernels for the decoder layer on the GPU.

At small batch a layer's norms, rotary embedding and activation are a few thousand elements each:
their cost is one kernel launch apiece, not bytes. At up to 16 rows the norms and activation fold
into the matmuls (skinny_gemm.py) and rotary joins the KV write (`rope_write_kv`); past that these
kernels run beside cuBLAS.
Each kernel has a checked launcher and a PyTorch reference beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verify_kernels.reference import write_kv_ref


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    stride_x, stride_o,
    hidden, eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    s32 = x.to(tl.float32)
    var = tl.sum(s32 * s32, axis=0) / hidden
    normed = (s32 * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    """rmsnorm(x) * weight, rounded to the model dtype before the weight as in eager."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with contiguous rows"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    out = torch.empty_like(x)
    t, h = x.shape
    if t:
        _rms_norm_kernel[(t,)](x, weight, out, x.stride(0), out.stride(0), h, eps,
                               BLOCK=triton.next_power_of_2(h))
    return out


def rms_norm_ref(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@triton.jit
def _embed_scaled_kernel(
    ids_ptr,  # [T] int64
    table_ptr,  # [V, H]
    g_ptr,  # [H] the first layer's input norm weight
    out_ptr,  # [T, H] the residual stream
    scaled_ptr,  # [T, H] rows times g, the norm's input for the qkv matmul
    ss_ptr,  # [1, T] float32 sums of squares of the rows
    stride_table, hidden,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    tok = tl.load(ids_ptr + row)
    x = tl.load(table_ptr + tok * stride_table + cols, mask=m, other=0.0)
    tl.store(out_ptr + row * hidden + cols, x, mask=m)
    xf = x.to(tl.float32)
    tl.store(ss_ptr + row, tl.sum(xf * xf, axis=0))
    g = tl.load(g_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + row * hidden + cols, (xf * g).to(scaled_ptr.dtype.element_ty), mask=m)


def embed_scaled(
    ids: torch.Tensor,  # [T] int64
    table: torch.Tensor,  # [V, H]
    norm_weight: torch.Tensor,  # [H]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The embedding rows of `ids` ([T, H], the residual stream) and the first RMSNorm's input
    as a residual-writing matmul would leave it (skinny_gemm.ScaledRows' fields: the rows times
    `norm_weight` in the table's dtype, and their float32 sums of squares as one partial,
    [1, T]). The first layer's qkv matmul then takes it as `prenormed`, like every other layer:
    no norm folded into its loop, one tile choice shared by all layers. Ids are not checked
    here (the engine checks them on admission)."""
    assert ids.dim() == 1 and ids.dtype == torch.int64 and ids.is_contiguous()
    assert table.dim() == 2 and table.stride(1) == 1
    assert norm_weight.shape == (table.shape[1],) and norm_weight.is_contiguous()
    t, h = ids.shape[0], table.shape[1]
    out = torch.empty(t, h, dtype=table.dtype, device=table.device)
    scaled = torch.empty_like(out)
    ss = torch.empty(1, t, dtype=torch.float32, device=table.device)
    if t:
        _embed_scaled_kernel[(t,)](ids, table, norm_weight, out, scaled, ss, table.stride(0), h,
                                   BLOCK=triton.next_power_of_2(h))
    return out, scaled, ss


def embed_scaled_ref(ids, table, norm_weight):
    x = table[ids]
    xf = x.float()
    return x, (xf * norm_weight.float()).to(table.dtype), xf.pow(2).sum(-1)[None, :]


def rope_ref(x, positions, inv_freq, scaling=1.0):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * scaling)[:, None, :], (emb.sin() * scaling)[:, None, :]
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@triton.jit
def _rope_table_kernel(
    pos_ptr,  # [T] int64
    inv_ptr,  # [D / 2] float32
    out_ptr,  # [T, 2, D] float32
    scaling,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + d % (HEAD_DIM // 2))
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    tl.store(out_ptr + t * 2 * HEAD_DIM + d, tl.cos(freq) * scaling)
    tl.store(out_ptr + t * 2 * HEAD_DIM + HEAD_DIM + d, sign * tl.sin(freq) * scaling)


def rope_table(
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D / 2] float32
    scaling: float,
) -> torch.Tensor:  # [T, 2, D] float32
    """Each row's rotary factors, once per step for every layer: [t, 0] = cos * scaling and
    [t, 1] = sin * scaling, negated over the first half, so that a kernel rotates x as
    x * [t, 0] + x[(d + D / 2) % D] * [t, 1]. Tree attention computed them in every program for
    all its rows: per layer on the H200 (Llama-3.1-8B heads, 1k context) 12.89 us at 8 rows
    and 9.73 at 2, against 9.75 and 8.42 with this table and the query rows loaded first
    (bench/results/gpu_attn_parts_h200_20261201_before.json and _table.json)."""
    d = 2 * inv_freq.shape[0]
    assert positions.dim() == 1 and inv_freq.dtype == torch.float32 and d & (d - 1) == 0
    out = torch.empty((positions.shape[0], 2, d), dtype=torch.float32, device=positions.device)
    if positions.shape[0]:
        _rope_table_kernel[(positions.shape[0],)](positions, inv_freq, out, scaling,
                                                  HEAD_DIM=d)
    return out


def rope_table_ref(positions, inv_freq, scaling):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.shape[0]
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(emb.device)
    return torch.stack([emb.cos() * scaling, sign * emb.sin() * scaling], dim=1)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, Hq, D], rotated in place
    k_ptr,  # [T, Hkv, D], read only: the rotated keys go to the cache
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], slots contiguous
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], slots contiguous
    pos_ptr,  # [T] int64
    inv_ptr,  # [D / 2] float32
    slot_ptr,  # [T] int64, negative = padding, not written
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch,
    scaling,
    NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freq = pos * tl.load(inv_ptr + d)
    cos = tl.cos(freq) * scaling
    sin = tl.sin(freq) * scaling
    if h < NUM_Q_HEADS:
        base = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(base + d).to(tl.float32)
        x2 = tl.load(base + HALF + d).to(tl.float32)
        tl.store(base + d, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty))
        tl.store(base + HALF + d, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty))
    else:
        hk = h - NUM_Q_HEADS
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            src = k_ptr + t * stride_kt + hk * stride_kh
            x1 = tl.load(src + d).to(tl.float32)
            x2 = tl.load(src + HALF + d).to(tl.float32)
            # Rounded to the model dtype first, as the unfused path stores rotated k.
            r1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
            r2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
            dst = slot * stride_cslot + hk * stride_ch
            tl.store(k_cache_ptr + dst + d, r1.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_cache_ptr + dst + HALF + d, r2.to(k_cache_ptr.dtype.element_ty))
            vsrc = v_ptr + t * stride_vt + hk * stride_vh
            v1 = tl.load(vsrc + d)
            v2 = tl.load(vsrc + HALF + d)
            tl.store(v_cache_ptr + dst + d, v1.to(v_cache_ptr.dtype.element_ty))
            tl.store(v_cache_ptr + dst + HALF + d, v2.to(v_cache_ptr.dtype.element_ty))


def rope_write_kv(
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D / 2] float32
    scaling: float,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Rotary on q (in place) and k, and the step's K/V into the cache, in one launch."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert k.shape == (t, hkv, d) and v.shape == (t, hkv, d), "q, k, v shapes"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.shape[2:] == (hkv, d) and v_cache.shape == k_cache.shape
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "slots must be contiguous"
    assert positions.shape == (t,) and slot_mapping.shape == (t,)
    assert inv_freq.shape == (d // 2,) and inv_freq.dtype == torch.float32
    assert (d // 2) & (d // 2 - 1) == 0, "head_dim / 2 must be a power of two"
    if t:
        _rope_write_kv_kernel[(t, hq + hkv)](
            q, k, v, k_cache, v_cache, positions, inv_freq, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(1), k_cache.stride(2), scaling, NUM_Q_HEADS=hq, HALF=d // 2)


def rope_write_kv_ref(q, k, v, positions, inv_freq, scaling, k_cache, v_cache, slot_mapping):
    q.copy_(rope_ref(q, positions, inv_freq, scaling))
    keep = slot_mapping >= 0
    kr = rope_ref(k, positions, inv_freq, scaling)
    write_kv_ref(kr[keep], v[keep], k_cache, v_cache, slot_mapping[keep])


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_gu, stride_o, inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=m, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, act * u.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0),
                                                         out.stride(0), inter, BLOCK=block)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
