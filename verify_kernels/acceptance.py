"""On-device draft-tree acceptance for a whole batch in one launch.

The rules and the reference are `reference.verify_tree`; this kernel walks the same path
with one program per sequence. The current target distribution r is kept lazily: either a row
of `probs` with its normaliser s (r = row / s), or, after a rejection, a normalised residual in
the sequence's row of a [B, V] float32 workspace. Every pass over r streams the vocabulary in
BLOCK_V chunks. Children are found by scanning the sequence's nodes after the current one
(a parent precedes its children, siblings are in order of preference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from verify_kernels.reference import VerifyResult, verify_tree

if TYPE_CHECKING:
    from drafters.tree import DraftTree

__all__ = ["accept_tree", "verify_tree"]


@triton.jit
def _row_sum(r_ptr, scale, vocab, BLOCK_V: tl.constexpr):
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        o = start + offs
        acc += tl.load(r_ptr + o, mask=o < vocab, other=0.0) / scale
    return tl.sum(acc, 0)


@triton.jit
def _row_argmax(r_ptr, scale, vocab, BLOCK_V: tl.constexpr):
    """First index of the maximum of r_ptr[:vocab] / scale."""
    offs = tl.arange(0, BLOCK_V)
    best = float("-inf")
    best_i = 0
    for start in range(0, vocab, BLOCK_V):
        o = start + offs
        r = tl.load(r_ptr + o, mask=o < vocab, other=float("-inf")) / scale
        cmax = tl.max(r, 0)
        # First index reaching the chunk maximum; a later chunk must be strictly larger.
        cidx = tl.min(tl.where(r == cmax, o, vocab), 0)
        take = cmax > best
        best_i = tl.where(take, cidx, best_i)
        best = tl.where(take, cmax, best)
    return best_i


@triton.jit
def _residual(r_ptr, scale, q_ptr, x, ws_row, vocab, STOCHASTIC: tl.constexpr,
              BLOCK_V: tl.constexpr):
    """Write normalise(max(r - q, 0)) (stochastic) or normalise(r with r[x] = 0) into ws_row.

    Returns 1 when written, 0 when the residual had no mass (r is then left as it was)."""
    offs = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        o = start + offs
        ok = o < vocab
        r = tl.load(r_ptr + o, mask=ok, other=0.0) / scale
        if STOCHASTIC:
            r = tl.maximum(r - tl.load(q_ptr + o, mask=ok, other=0.0), 0.0)
        else:
            r = tl.where(o == x, 0.0, r)
        acc += r
    total = tl.sum(acc, 0)
    wrote = 0
    if total > 1e-20:
        for start in range(0, vocab, BLOCK_V):
            o = start + offs
            ok = o < vocab
            r = tl.load(r_ptr + o, mask=ok, other=0.0) / scale
            if STOCHASTIC:
                r = tl.maximum(r - tl.load(q_ptr + o, mask=ok, other=0.0), 0.0)
            else:
                r = tl.where(o == x, 0.0, r)
            tl.store(ws_row + o, r / tl.maximum(total, 1e-30), mask=ok)
        wrote = 1
    tl.debug_barrier()  # later scalar reads of ws_row come from other threads
    return wrote


@triton.jit
def _sample_inverse_cdf(r_ptr, scale, u, vocab, BLOCK_V: tl.constexpr):
    """Number of cdf entries <= u * cdf[-1] (torch.searchsorted(right=True)), clamped."""
    offs = tl.arange(0, BLOCK_V)
    carry = 0.0
    for start in range(0, vocab, BLOCK_V):
        o = start + offs
        carry += tl.sum(tl.load(r_ptr + o, mask=o < vocab, other=0.0) / scale, 0)
    target = u * carry
    count = 0
    carry = 0.0
    for start in range(0, vocab, BLOCK_V):
        o = start + offs
        ok = o < vocab
        r = tl.load(r_ptr + o, mask=ok, other=0.0) / scale
        cdf = carry + tl.cumsum(r, 0)
        count += tl.sum(((cdf <= target) & ok).to(tl.int32), 0)
        carry += tl.sum(r, 0)
    return tl.minimum(count, vocab - 1)


@triton.jit
def _accept_kernel(
    tokens_out_ptr,  # [B, D + 1] int64, -1 filled
    num_out_ptr,  # [B] int64
    accepted_out_ptr,  # [B, D] int64, -1 filled
    ws_ptr,  # [B, V] float32 residual workspace
    probs_ptr,  # [R, V] float32
    row_offsets_ptr,  # [B] int64
    node_offsets_ptr,  # [B + 1] int64
    node_tokens_ptr,  # [N] int64
    parents_ptr,  # [N] int64
    draft_probs_ptr,  # [N, V] float32 (read only when HAS_DRAFT)
    stochastic_ptr,  # [N] uint8 (read only when HAS_DRAFT)
    greedy_ptr,  # [B] uint8
    node_u_ptr,  # [N] float32
    bonus_u_ptr,  # [B] float32
    vocab, max_depth, stride_p, stride_q, stride_w, stride_t, stride_a,
    HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row0 = tl.load(row_offsets_ptr + b)
    n0 = tl.load(node_offsets_ptr + b)
    n = tl.load(node_offsets_ptr + b + 1) - n0
    greedy = tl.load(greedy_ptr + b) != 0
    sampled = tl.load(greedy_ptr + b) == 0
    ws_row = ws_ptr + b * stride_w
    row_ptr = probs_ptr + row0 * stride_p  # the current node's target row
    s = tl.maximum(_row_sum(row_ptr, 1.0, vocab, BLOCK_V), 1e-30)
    in_ws = 0  # 1 once r lives in ws_row (already normalised)
    cur = n * 0 - 1  # local node index, -1 = the root
    depth = 0
    alive = 1
    while (alive != 0) & (depth < max_depth):
        best = -1
        if greedy:
            best = _row_argmax(row_ptr, s, vocab, BLOCK_V)
        moved = 0
        j = cur + 1
        while (j < n) & (moved == 0):
            if tl.load(parents_ptr + n0 + j) == cur:
                x = tl.load(node_tokens_ptr + n0 + j)
                u = tl.load(node_u_ptr + n0 + j)
                r_ptr = tl.where(in_ws != 0, ws_row, row_ptr)
                scale = tl.where(in_ws != 0, 1.0, s)
                rx = tl.load(r_ptr + x) / scale
                stoch = 0
                qx = 0.0
                if HAS_DRAFT:
                    stoch = tl.load(stochastic_ptr + n0 + j).to(tl.int32)
                    qx = tl.load(draft_probs_ptr + (n0 + j) * stride_q + x)
                ok = tl.where(stoch != 0, u * qx < rx, u < rx)
                ok = tl.where(greedy, x == best, ok)
                if ok:
                    tl.store(tokens_out_ptr + b * stride_t + depth, x)
                    tl.store(accepted_out_ptr + b * stride_a + depth, j)
                    cur = j
                    moved = 1
                elif sampled:
                    wrote = 0
                    if stoch != 0:
                        wrote = _residual(r_ptr, scale, draft_probs_ptr + (n0 + j) * stride_q,
                                          x, ws_row, vocab, True, BLOCK_V)
                    else:
                        wrote = _residual(r_ptr, scale, draft_probs_ptr, x, ws_row, vocab,
                                          False, BLOCK_V)
                    in_ws = tl.maximum(in_ws, wrote)
            j += 1
        if moved != 0:
            depth += 1
            row_ptr = probs_ptr + (row0 + cur + 1) * stride_p
            s = tl.maximum(_row_sum(row_ptr, 1.0, vocab, BLOCK_V), 1e-30)
            in_ws = 0
        else:
            alive = 0
    r_ptr = tl.where(in_ws != 0, ws_row, row_ptr)
    scale = tl.where(in_ws != 0, 1.0, s)
    if greedy:
        bonus = _row_argmax(r_ptr, scale, vocab, BLOCK_V).to(tl.int64)
    else:
        u = tl.load(bonus_u_ptr + b)
        bonus = _sample_inverse_cdf(r_ptr, scale, u, vocab, BLOCK_V).to(tl.int64)
    tl.store(tokens_out_ptr + b * stride_t + depth, bonus)
    tl.store(num_out_ptr + b, (depth + 1).to(tl.int64))


def accept_tree(
    probs: torch.Tensor,  # [R, V] float32, target distribution per query row
    row_offsets: torch.Tensor,  # [B] int64, row of each sequence's root
    tree: DraftTree,
    greedy: torch.Tensor,  # [B] bool
    node_uniforms: torch.Tensor,  # [N] float32 in [0, 1)
    bonus_uniforms: torch.Tensor,  # [B] float32 in [0, 1)
    workspace: torch.Tensor | None = None,  # [B, V] float32 residual scratch
) -> VerifyResult:
    """`verify_tree` on the device, one program per sequence (same inputs, same outputs)."""
    dev = probs.device
    bsz, vocab = tree.num_seqs, probs.shape[1]
    depth = tree.max_depth()
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(1) == 1
    assert row_offsets.shape == (bsz,) and row_offsets.dtype == torch.int64
    assert greedy.shape == (bsz,) and greedy.dtype == torch.bool
    assert node_uniforms.shape == (tree.num_nodes,) and node_uniforms.dtype == torch.float32
    assert bonus_uniforms.shape == (bsz,) and bonus_uniforms.dtype == torch.float32
    assert row_offsets.device == greedy.device == node_uniforms.device == dev
    assert bonus_uniforms.device == dev
    has_draft = tree.draft_probs is not None
    assert has_draft == (tree.stochastic is not None), "draft_probs and stochastic go together"
    if workspace is None:
        workspace = torch.empty((bsz, vocab), dtype=torch.float32, device=dev)
    assert workspace.shape[0] >= bsz and workspace.shape[1] == vocab
    assert workspace.dtype == torch.float32 and workspace.stride(1) == 1
    tokens = torch.full((bsz, depth + 1), -1, dtype=torch.long, device=dev)
    num = torch.empty(bsz, dtype=torch.long, device=dev)
    accepted = torch.full((bsz, depth), -1, dtype=torch.long, device=dev)
    if bsz == 0:
        return VerifyResult(tokens, num, accepted)
    node_offsets = torch.tensor(tree.offsets, dtype=torch.long).to(dev, non_blocking=True)
    node_tokens = tree.tokens.to(dev)
    parents = tree.parents.to(dev)
    if has_draft:
        draft = tree.draft_probs.to(dev, torch.float32)  # [N, V]
        assert draft.shape == (tree.num_nodes, vocab) and draft.stride(1) == 1
        stoch = tree.stochastic.to(dev).view(torch.uint8)
    else:
        draft, stoch = probs, greedy.view(torch.uint8)  # never read
    _accept_kernel[(bsz,)](
        tokens, num, accepted, workspace, probs, row_offsets, node_offsets, node_tokens, parents,
        draft, stoch, greedy.view(torch.uint8), node_uniforms, bonus_uniforms,
        vocab, depth, probs.stride(0), draft.stride(0), workspace.stride(0), tokens.stride(0),
        max(accepted.stride(0), 1),
        HAS_DRAFT=has_draft, BLOCK_V=2048, num_warps=8,
    )
    return VerifyResult(tokens, num, accepted)
