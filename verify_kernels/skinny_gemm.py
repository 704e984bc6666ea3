"""Linear layers over few rows (decode and small verification steps), with the layer's
elementwise work folded in.

At up to 16 rows a linear layer streams its weight once and does almost no arithmetic, so the
step's other kernels (RMSNorm, SiLU-and-multiply, the residual add) cost a launch each and
nothing else. This kernel folds them into the matmul:

- `norm_weight`: the input is RMS-normalised on the fly. rmsnorm(x) @ W^T equals
  rstd * ((x * g) @ W^T), and the sum of squares behind rstd accumulates in the same pass over K
  that feeds the matmul, so the norm costs no extra read;
- `silu_mul`: the input is [M, 2K] (gate | up) and silu(gate) * up is formed as it is loaded;
- `gated`: the weight is [2N, K] (gate rows, then up rows, as a fused gate_up projection) and
  the output is silu(gate) * up, [M, N]: each program computes the gate and up columns it pairs,
  so the activation is an epilogue and the next matmul reads [M, N] as it is;
- `residual`: the output is added to `residual` (which may be the output buffer itself: each
  program reads and writes only its own columns), and `bias` is added before it;
- the norm hand-off (`residual_linear`, `prenormed`): a residual-writing matmul also stores its
  rows times the next norm's weight and, per program, their sums of squares over its columns
  (`ScaledRows`). The matmul after the norm reads those rows as they are and scales its output
  by rstd. The first norm's input comes the same way from the embedding lookup
  (`fused_ops.embed_scaled`); of a model's norms only the final one, before the LM head, runs
  otherwise.

A program owns BLOCK_N output columns of every row and walks K. It reduces either with FMAs
(the prologues fold in; one row always, and up to 8 rows as a candidate) or with tensor-core
dots over a 16-row tile: the x tile against the weight tile (the prologue then runs first as a
kernel of its own: folded into that loop it stalled the weight pipeline, an 8-row step took
11.0 ms instead of 5.25 on an H200), or swapped, the weight tile against x (skinny_tiles.py).
Which, and the tile sizes, are chosen per shape and row count by timing on first use, and
kept in the caller's `tiles` (skinny_tiles.TileChoices); the graph runner may then re-choose
them by timing the whole captured step. `pdl`: programmatic dependent launch (pdl.py), off
unless the caller turns it on. The PyTorch reference is `skinny_linear_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from verify_kernels.pdl import pdl_args, pdl_wait_release
from verify_kernels.skinny_tiles import TileChoices

MAX_ROWS = 16


@triton.jit
def _load_rows(rows, ks, mask_n, mask_k, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(rows + ks[None, :])
    return tl.load(rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    if BLOCK_M == 1:
        acc += tl.sum(w.to(tl.float32) * x, axis=1)[None, :]
    elif FMA:  # [BLOCK_M, BLOCK_N, BLOCK_K] products, reduced over K
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
    elif SWAP:  # acc is [BLOCK_N, BLOCK_M]: the weight tile is the MMA's wide operand
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _chunk(acc, acc_up, ss, w, w_up, x_rows, g_ptr, ks, mask_m, K,
           NORM: tl.constexpr, SILU_MUL: tl.constexpr, GATED: tl.constexpr,
           BLOCK_M: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr,
           DOT_PRECISION: tl.constexpr):
    """One K tile: load x (with its prologue) and accumulate against the loaded weights."""
    mask_k = ks < K
    xm = mask_m[:, None] & mask_k[None, :]
    if SILU_MUL:
        gate = tl.load(x_rows + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        x = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_M, BLOCK_K]
    else:
        x = tl.load(x_rows + ks[None, :], mask=xm, other=0.0)
        if NORM or FMA or BLOCK_M == 1:  # dot tiles take x in the model dtype as it is
            x = x.to(tl.float32)
    if NORM:
        ss += tl.sum(x * x, axis=1)
        g = tl.load(g_ptr + ks, mask=mask_k, other=0.0).to(tl.float32)
        x = x * g[None, :]
    acc = _accumulate(acc, w, x, BLOCK_M, FMA, SWAP, DOT_PRECISION)
    if GATED:
        acc_up = _accumulate(acc_up, w_up, x, BLOCK_M, FMA, SWAP, DOT_PRECISION)
    return acc, acc_up, ss


@triton.jit
def _epilogue(acc, acc_up, ss, rm, rn, mask_m, mask_n, pid, out_ptr, bias_ptr, res_ptr, gn_ptr,
              scaled_ptr, ss_out_ptr, M, N, K, stride_om, stride_rm, eps,
              RSTD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr, EMIT: tl.constexpr):
    """rstd, bias, activation, residual on [BLOCK_M, BLOCK_N] sums; the store; the hand-off."""
    if RSTD:
        rstd = tl.rsqrt(ss / K + eps)[:, None]
        acc = acc * rstd
        acc_up = acc_up * rstd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    om = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=om, other=0.0)
        acc += res.to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y, mask=om)
    if EMIT:  # the next norm's input, from the rounded values the residual stream keeps
        yf = tl.where(om, y.to(tl.float32), 0.0)
        tl.store(ss_out_ptr + pid * M + rm, tl.sum(yf * yf, axis=1), mask=mask_m)
        gn = tl.load(gn_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + rm[:, None] * N + rn[None, :],
                 (yf * gn[None, :]).to(scaled_ptr.dtype.element_ty), mask=om)


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K], or [M, 2K] (gate | up) with SILU_MUL
    w_ptr,  # [N, K], or [2N, K] (gate rows | up rows) with GATED
    out_ptr,  # [M, N]
    bias_ptr,  # [N], or [2N] with GATED (any pointer without HAS_BIAS)
    res_ptr,  # [M, N], may be out_ptr (any pointer without HAS_RES)
    g_ptr,  # [K] norm weight (any pointer without NORM)
    ss_in_ptr,  # [P_in, M] float32 partial sums of squares of x's rows (with PRENORMED)
    gn_ptr,  # [N] the next norm's weight (with EMIT)
    scaled_ptr,  # [M, N] out * gn, that norm's input for the next matmul (with EMIT)
    ss_out_ptr,  # [cdiv(N, BLOCK_N), M] float32: each column tile's sums of squares (EMIT)
    M, N, K, P_in,
    stride_xm, stride_wn, stride_om, stride_rm,
    eps,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, FMA: tl.constexpr, SWAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, PRENORMED: tl.constexpr, EMIT: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mask_n = rn < N
    mask_m = rm < M
    if SWAP:  # transposed until the epilogue
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED only
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    # The first weight tile does not depend on the kernel before this one: under PDL it is
    # in flight while that kernel finishes (verify_kernels/pdl.py).
    w = _load_rows(w_rows, rk, mask_n, rk < K, EVEN)  # [BLOCK_N, BLOCK_K]
    w_up = w
    if GATED:
        w_up = _load_rows(w_rows + N * stride_wn, rk, mask_n, rk < K, EVEN)
    pdl_wait_release(USE_PDL)
    if PRENORMED:  # x is already x * g; rstd comes from the producer's partial sums
        for p0 in range(0, P_in, BLOCK_P):  # one pass when BLOCK_P covers them: no latency
            ps = p0 + tl.arange(0, BLOCK_P)
            part = tl.load(ss_in_ptr + ps[:, None] * M + rm[None, :],
                           mask=(ps < P_in)[:, None] & mask_m[None, :], other=0.0)
            ss += tl.sum(part, axis=0)
    acc, acc_up, ss = _chunk(acc, acc_up, ss, w, w_up, x_rows, g_ptr, rk, mask_m, K, NORM,
                             SILU_MUL, GATED, BLOCK_M, FMA, SWAP, DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + rk
        w = _load_rows(w_rows, ks, mask_n, ks < K, EVEN)
        w_up = w
        if GATED:
            w_up = _load_rows(w_rows + N * stride_wn, ks, mask_n, ks < K, EVEN)
        acc, acc_up, ss = _chunk(acc, acc_up, ss, w, w_up, x_rows, g_ptr, ks, mask_m, K, NORM,
                                 SILU_MUL, GATED, BLOCK_M, FMA, SWAP, DOT_PRECISION)
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    _epilogue(acc, acc_up, ss, rm, rn, mask_m, mask_n, pid, out_ptr, bias_ptr, res_ptr, gn_ptr,
              scaled_ptr, ss_out_ptr, M, N, K, stride_om, stride_rm, eps, NORM or PRENORMED,
              GATED, HAS_BIAS, HAS_RES, EMIT)


# Rows from which a residual-writing matmul leaves the next norm's input (`residual_linear`).
# From one row: the batch-1 decode step measured 4.12 ms against 4.14 with one-row steps
# keeping the norm in their FMA loop, and 2-8-row steps 63-70 us faster than with the norm as
# a kernel of its own (bench/results/gpu_verify_attn_h200_20261130_emit.json).
EMIT_MIN_ROWS = 1


@dataclass(frozen=True)
class ScaledRows:
    """An RMSNorm's input as the residual-writing matmul before it left it (`residual_linear`):
    the rows times the norm weight, and each of that matmul's programs' sums of squares of the
    rows over its columns. The matmul that consumes them (`prenormed=`) reads `scaled` as is and
    applies rstd to its output, so the norm is neither a kernel of its own nor work in the dot
    loop."""

    scaled: torch.Tensor  # [M, K] x * g, model dtype
    sumsq: torch.Tensor  # [P, M] float32 partial sums of x * x; their total over P per row


def skinny_linear(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K], or [2N, K] with gated
    bias: torch.Tensor | None = None,  # [N], or [2N] with gated
    *,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    silu_mul: bool = False,
    gated: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]; the result is written here when out is None
    out_dtype: torch.dtype | None = None,
    prenormed: ScaledRows | None = None,  # norm_weight's input, as the matmul before left it
    tiles: TileChoices | None = None,  # the caller's tile choices; None: for this call alone
    pdl: bool = False,
) -> torch.Tensor:  # [M, N]
    """epilogue(linear(prologue(x), weight, bias)) (+ residual, in place): see the module
    docstring."""
    return _skinny(x, weight, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                   gated=gated, residual=residual, out_dtype=out_dtype, prenormed=prenormed,
                   emit_norm=None, tiles=tiles, pdl=pdl)[0]


def _skinny(x, weight, bias, *, norm_weight, eps, silu_mul, gated, residual, out_dtype,
            prenormed, emit_norm, tiles: TileChoices | None, pdl: bool
            ) -> tuple[torch.Tensor, ScaledRows | None]:
    """skinny_linear, and with `emit_norm` ([N], needs `residual`) also the ScaledRows that
    residual_linear hands on."""
    m = x.shape[0]
    n, k = weight.shape
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    assert 0 < m <= MAX_ROWS, f"{m} rows: skinny_linear serves 1..{MAX_ROWS}"
    assert x.shape[1] == (2 * k if silu_mul else k), (tuple(x.shape), tuple(weight.shape))
    assert not (silu_mul and norm_weight is not None), "one prologue at a time"
    assert x.device == weight.device
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if prenormed is not None:
        assert norm_weight is not None, "prenormed is the input of norm_weight's norm"
        assert prenormed.scaled.shape == x.shape and prenormed.scaled.is_contiguous()
        assert prenormed.sumsq.shape[1:] == (m,) and prenormed.sumsq.dtype == torch.float32
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    if gated:
        assert n % 2 == 0 and weight.is_contiguous(), "gated needs [2N, K] contiguous rows"
        n //= 2
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
        out = residual
    else:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if emit_norm is not None:
        assert residual is not None and emit_norm.shape == (n,) and emit_norm.is_contiguous()
    rows = 1 << (m - 1).bit_length()
    key = (rows, n, k, x.dtype, weight.dtype, norm_weight is not None, silu_mul,
           bias is not None, residual is not None, gated, prenormed is not None,
           emit_norm is not None)
    tiles = tiles if tiles is not None else TileChoices()
    tiles.record(key)

    def launch(cfg: tuple, o: torch.Tensor, r: torch.Tensor | None) -> ScaledRows | None:
        bn, bk, warps, stages, kind = cfg
        xin, g, silu = x, norm_weight, silu_mul
        if prenormed is not None:
            xin, g = prenormed.scaled, None
        elif kind == "dot" and (g is not None or silu):  # the prologue runs first
            from verify_kernels.fused_ops import rms_norm
            from verify_kernels.fused_ops import silu_mul as silu_mul_

            xin = silu_mul_(x) if silu else rms_norm(x, g, eps)
            g, silu = None, False
        grid = triton.cdiv(n, bn)
        emitted = None
        if emit_norm is not None:
            emitted = ScaledRows(torch.empty(m, n, dtype=o.dtype, device=o.device),
                                 torch.empty(grid, m, dtype=torch.float32, device=o.device))
        block_m = rows if kind == "fma" else 16
        ss_in, p_in, block_p = weight, 0, 1  # the producer's partial sums (with prenormed)
        if prenormed is not None:
            ss_in, p_in = prenormed.sumsq, prenormed.sumsq.shape[0]
            # All of them in one tile, up to 4096 values (registers).
            block_p = min(triton.next_power_of_2(p_in), max(64, 4096 // block_m))
        _skinny_kernel[(grid,)](
            xin, weight, o, bias if bias is not None else weight, r if r is not None else o,
            g if g is not None else weight, ss_in,
            emit_norm if emitted is not None else weight,
            emitted.scaled if emitted is not None else o,
            emitted.sumsq if emitted is not None else weight,
            m, n, k, p_in, xin.stride(0), weight.stride(0), o.stride(0),
            r.stride(0) if r is not None else 0, eps,
            NORM=g is not None, SILU_MUL=silu, GATED=gated, HAS_BIAS=bias is not None,
            HAS_RES=r is not None, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
            EVEN=n % bn == 0 and k % bk == 0, FMA=kind == "fma", SWAP=kind == "swap",
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            PRENORMED=prenormed is not None, EMIT=emitted is not None,
            BLOCK_P=block_p,
            num_warps=warps, num_stages=stages, **pdl_args(x.device, pdl))
        return emitted

    return out, launch(tiles.choose(key, m, launch, out, residual, x.device), out, residual)


def skinny_linear_ref(x, weight, bias=None, *, norm_weight=None, eps=1e-6, silu_mul=False,
                      gated=False, residual=None, out_dtype=None):
    """The same result with PyTorch ops, in float32 (residual left untouched)."""
    xf = x.float()
    if silu_mul:
        gate, up = xf.chunk(2, dim=-1)
        xf = torch.nn.functional.silu(gate) * up
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = xf @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(residual.dtype if residual is not None else out_dtype or x.dtype)


def fused_linear(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_mul: bool = False,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    prenormed: ScaledRows | None = None,
    tiles: TileChoices | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """skinny_linear's contract at any row count: past MAX_ROWS the prologue and epilogue are
    kernels of their own around cuBLAS, where a launch is small beside the matmul."""
    if 0 < x.shape[0] <= MAX_ROWS:
        return skinny_linear(x, weight, bias, norm_weight=norm_weight, eps=eps,
                             silu_mul=silu_mul, gated=gated, residual=residual,
                             out_dtype=out_dtype, prenormed=prenormed, tiles=tiles, pdl=pdl)
    from verify_kernels.fused_ops import rms_norm
    from verify_kernels.fused_ops import silu_mul as silu_mul_

    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if silu_mul:
        x = silu_mul_(x)
    y = torch.nn.functional.linear(x, weight, bias)
    if gated:
        y = silu_mul_(y)
    if residual is not None:
        return residual.add_(y)
    return y if out_dtype is None else y.to(out_dtype)


def residual_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N]
    residual: torch.Tensor,  # [M, N], updated in place
    next_norm: torch.Tensor | None = None,  # [N] the weight of the RMSNorm that reads residual
    tiles: TileChoices | None = None,
    pdl: bool = False,
) -> ScaledRows | None:
    """residual += linear(x); at EMIT_MIN_ROWS..MAX_ROWS rows with `next_norm`, also that norm's
    input for the matmul after it (ScaledRows, pass it as `prenormed`), else None."""
    if next_norm is None or not EMIT_MIN_ROWS <= x.shape[0] <= MAX_ROWS:
        fused_linear(x, weight, bias, residual=residual, tiles=tiles, pdl=pdl)
        return None
    return _skinny(x, weight, bias, norm_weight=None, eps=0.0, silu_mul=False, gated=False,
                   residual=residual, out_dtype=None, prenormed=None, emit_norm=next_norm,
                   tiles=tiles, pdl=pdl)[1]
