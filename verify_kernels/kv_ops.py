"""KV cache writes by slot mapping, and compaction of accepted draft-tree paths.

`write_kv` scatters a step's new K/V rows ([T, Hkv, D]) into one layer's paged caches at
`slot_mapping` (a negative slot skips its row, for padded batches). `compact_kv` moves accepted
tree nodes' entries down to their final positions, for every layer and both K and V at once:
slots index the flattened `num_blocks * block_size` axis of the engine's single
[L, 2, num_blocks, block_size, Hkv, D] tensor.

Compaction moves are chain-like: a node's destination can be another accepted node's source
(dst < src for every pair). Each program owns one (layer, K|V, feature chunk) and walks the pairs
in ascending destination order, loading a batch of sources before storing it, so every source is
read before any pair that overwrites it, the same result as gathering all sources first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from verify_kernels.reference import write_kv_ref

__all__ = ["compact_kv", "compact_kv_ref", "write_kv", "write_kv_ref"]


def compact_kv_ref(
    kv: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    flat = kv.view(kv.shape[0], 2, -1, *kv.shape[4:])  # [L, 2, NB * BS, Hkv, D]
    flat[:, :, dst_slots] = flat[:, :, src_slots].clone()


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], slots contiguous
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], slots contiguous
    slot_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_ch,
    NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM_P)
        mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    assert k.dim() == 3 and k.shape == v.shape, "k, v [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    assert k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride()
    t, hkv, d = k.shape
    assert k_cache.shape[2:] == (hkv, d), f"cache heads/dim {k_cache.shape[2:]} != {(hkv, d)}"
    assert k.stride(2) == 1 and v.stride(2) == 1
    # The flattened slot axis needs the block and in-block strides to agree.
    assert k_cache.stride(3) == 1 and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    assert slot_mapping.shape == (t,) and slot_mapping.dtype == torch.int64
    assert k.device == k_cache.device == slot_mapping.device
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=hkv, HEADS_P=_next_pow2(hkv), HEAD_DIM=d, HEAD_DIM_P=_next_pow2(d),
        num_warps=4,
    )


@triton.jit(do_not_specialize=["num_pairs"])  # one compiled kernel, whatever the count
def _compact_kv_kernel(
    kv_ptr,  # [L, 2, NB * BS, ROW] with ROW = Hkv * D contiguous per slot
    src_ptr,  # [M] int64
    dst_ptr,  # [M] int64
    num_pairs, stride_l, stride_c, stride_slot,
    ROW: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_F: tl.constexpr,
):
    lc = tl.program_id(0)
    chunk = tl.program_id(1)
    base = kv_ptr + (lc // 2).to(tl.int64) * stride_l + (lc % 2).to(tl.int64) * stride_c
    f = chunk * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < ROW
    p = tl.arange(0, BLOCK_PAIRS)
    for start in range(0, num_pairs, BLOCK_PAIRS):
        ok = start + p < num_pairs
        src = tl.load(src_ptr + start + p, mask=ok, other=0)
        dst = tl.load(dst_ptr + start + p, mask=ok, other=0)
        m = ok[:, None] & f_ok[None, :]
        rows = tl.load(base + src[:, None] * stride_slot + f[None, :], mask=m)
        # Later batches may read what this batch wrote: keep the CTA's stores ordered first.
        tl.debug_barrier()
        tl.store(base + dst[:, None] * stride_slot + f[None, :], rows, mask=m)
        tl.debug_barrier()


def compact_kv(
    kv: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
    sorted_by_dst: bool = False,
) -> None:
    """kv[:, :, dst] = kv[:, :, src] over the flattened slot axis, all layers in one launch.

    Pairs are processed in order, and no pair may read a slot an earlier pair wrote. Pairs with
    src >= dst in ascending dst order have that, and so do runs of such pairs over disjoint
    slots (one run per sequence, as accepted tree paths give): pass `sorted_by_dst=True` for
    either. Otherwise the pairs are sorted by dst first."""
    assert kv.dim() == 6 and kv.shape[1] == 2, "kv [L, 2, NB, BS, Hkv, D]"
    assert kv.stride(5) == 1 and kv.stride(4) == kv.shape[5], "heads x dim must be contiguous"
    assert kv.stride(2) == kv.shape[3] * kv.stride(3), "blocks x slots must flatten"
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1
    assert src_slots.dtype == dst_slots.dtype == torch.int64
    assert src_slots.device == dst_slots.device == kv.device
    m = src_slots.shape[0]
    if m == 0:
        return
    if not sorted_by_dst:
        dst_slots, order = torch.sort(dst_slots)
        src_slots = src_slots[order]
    row = kv.shape[4] * kv.shape[5]
    block_f = min(1024, _next_pow2(row))
    grid = (kv.shape[0] * 2, triton.cdiv(row, block_f))
    _compact_kv_kernel[grid](
        kv, src_slots, dst_slots, m, kv.stride(0), kv.stride(1), kv.stride(3),
        ROW=row, BLOCK_PAIRS=8, BLOCK_F=block_f, num_warps=4,
    )
