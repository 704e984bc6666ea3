"""Row argmax over a large vocabulary in two short launches.

PyTorch's argmax reduces a row of 128k logits in one block: 38 us per decode step on the H200
(bench/results/gpu_decode_attn_*), about 1% of a batch-1 step. Here each row is cut into chunks
that programs reduce side by side (max and its first index), and a second launch picks, per
row, the largest chunk maximum with the smallest index. Ties resolve to the first index, as
`torch.argmax` does, so greedy choices do not depend on which path computed them. Rows holding
NaN are outside the contract (PyTorch returns the NaN's index; logits here are finite or -inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["argmax_triton"]

_CHUNK = 4096


@triton.jit
def _chunk_max_kernel(
    x_ptr,  # [R, V] float
    val_ptr,  # [R, C] float32, each chunk's maximum
    idx_ptr,  # [R, C] int32, its first index within the row
    vocab, stride_x, num_chunks,
    CHUNK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + r * stride_x + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, 0)
    # The first index holding the maximum (tl.argmax's tie rule is not part of its contract).
    i = tl.min(tl.where(x == m, offs, 2147483647), 0)
    tl.store(val_ptr + r * num_chunks + c, m)
    tl.store(idx_ptr + r * num_chunks + c, i)


@triton.jit
def _pick_kernel(
    val_ptr,  # [R, C] float32
    idx_ptr,  # [R, C] int32
    out_ptr,  # [R] int64
    num_chunks,
    CHUNKS_P: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P)
    ok = c < num_chunks
    v = tl.load(val_ptr + r * num_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + r * num_chunks + c, mask=ok, other=2147483647)
    m = tl.max(v, 0)
    # Chunks hold increasing indices, so the smallest index among the maxima is the first.
    tl.store(out_ptr + r, tl.min(tl.where(v == m, i, 2147483647), 0).to(tl.int64))


def argmax_triton(x: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """torch.argmax(x, dim=-1) for finite (or -inf) rows, by the kernels above."""
    assert x.dim() == 2 and x.stride(1) == 1, "rows of contiguous values"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    r, v = x.shape
    assert v < 2**31
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    if r == 0 or v == 0:
        return out if v else out.zero_()
    chunks = triton.cdiv(v, _CHUNK)
    vals = torch.empty(r, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(r, chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(r, chunks)](x, vals, idx, v, x.stride(0), chunks, CHUNK=_CHUNK,
                                   num_warps=8)
    _pick_kernel[(r,)](vals, idx, out, chunks, CHUNKS_P=max(16, triton.next_power_of_2(chunks)),
                       num_warps=1)
    return out
