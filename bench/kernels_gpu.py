"""Microbenchmark of the verification kernels on CUDA against torch on the dense problem.

Attention: the Triton paged kernel (block tables over shuffled blocks) against
`F.scaled_dot_product_attention` on contiguous K/V of the same lengths, for decode batches, draft
trees and prefill chunks. Where the engine's steps take a fused kernel instead (one row per
sequence: verify_kernels/decode_attention.py; a few rows in a small batch:
verify_kernels/tree_attention.py), that kernel too, as the engine calls it
(`TritonAttentionBackend.decode`): it also rotates the step's queries and keys and writes its
K/V to the cache, work the SDPA baseline leaves out. Acceptance: `accept_tree` against the
PyTorch `verify_tree`. Times are triton.testing.do_bench medians in microseconds.

    python3 bench/kernels_gpu.py --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
from triton.testing import do_bench, do_bench_cudagraph

from drafters.tree import DraftTree
from specdec.attention_metadata import AttentionMetadata
from specdec.cli_options import runtime_from_env
from verify_kernels.acceptance import accept_tree
from verify_kernels.backend import TritonAttentionBackend
from verify_kernels.paged_attention import choose_num_splits, paged_attention
from verify_kernels.reference import verify_tree

HQ, HKV, D, BS = 32, 8, 128, 16  # a Llama-3-8B-like layer
DEV = torch.device("cuda")
DT = torch.bfloat16
BACKEND = TritonAttentionBackend()


def median_us(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def graph_us(fn) -> float:
    """Median under a CUDA graph: device time without the host's launch overhead."""
    try:
        return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    except RuntimeError as e:  # a capture failure should not lose the other numbers
        print(f"cuda graph timing failed: {e!r}")
        return float("nan")


def random_parents(n: int, g: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]


def build(ctxs: list[int], qlens: list[int], masks: list[torch.Tensor | None],
          g: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata over shuffled blocks and the paged caches ([NB, BS, Hkv, D])."""
    bsz = len(ctxs)
    per = max(math.ceil((c + q) / BS) for c, q in zip(ctxs, qlens))
    nb = bsz * per
    tables = torch.randperm(nb, generator=g).int().view(bsz, per)
    offs, flat, off = [], [], 0
    for q, m in zip(qlens, masks):
        offs.append(-1 if m is None else off)
        if m is not None:
            flat.append(m.flatten())
            off += q * q
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEV),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([c + q for c, q in zip(ctxs, qlens)], dtype=torch.int32,
                              device=DEV),
        block_tables=tables.to(DEV),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=DEV),
        custom_mask=torch.cat(flat).to(DEV) if flat else None,
        mask_offsets=torch.tensor(offs, dtype=torch.int64, device=DEV),
        q_lens_host=tuple(qlens), context_lens_host=tuple(ctxs), mask_offsets_host=tuple(offs),
        block_size=BS,
    )
    k = torch.randn(nb, BS, HKV, D, device=DEV, dtype=DT)
    v = torch.randn(nb, BS, HKV, D, device=DEV, dtype=DT)
    return meta, k, v


def attention_case(name: str, ctxs: list[int], qlens: list[int],
                   masks: list[torch.Tensor | None], g: torch.Generator) -> dict:
    """Triton paged vs SDPA over dense [B, H, S, D] K/V (equal lengths across the batch)."""
    meta, k_cache, v_cache = build(ctxs, qlens, masks, g)
    bsz, q_len, seq = len(ctxs), qlens[0], ctxs[0] + qlens[0]
    q = torch.randn(sum(qlens), HQ, D, device=DEV, dtype=DT)
    row = {"case": name, "batch": bsz, "q_len": q_len, "context": ctxs[0]}
    row["triton_us"] = median_us(lambda: paged_attention(q, k_cache, v_cache, meta))
    splits = choose_num_splits(meta, HQ, HKV, DEV)
    row["num_splits"] = splits
    if splits > 1:
        row["triton_nosplit_us"] = median_us(
            lambda: paged_attention(q, k_cache, v_cache, meta, num_splits=1))
    qd = q.view(bsz, q_len, HQ, D).transpose(1, 2)  # [B, Hq, q, D]
    kd = torch.randn(bsz, HKV, seq, D, device=DEV, dtype=DT)
    vd = torch.randn(bsz, HKV, seq, D, device=DEV, dtype=DT)
    mask = None
    causal = False
    if masks[0] is not None or (ctxs[0] > 0 and q_len > 1):
        new = masks[0] if masks[0] is not None else torch.ones(q_len, q_len).tril().bool()
        full = torch.cat([torch.ones(q_len, ctxs[0], dtype=torch.bool), new.cpu()], dim=1)
        mask = full.to(DEV)[None, None].expand(bsz, 1, q_len, seq)
    elif q_len > 1:
        causal = True

    def sdpa_gqa():
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)

    ke = kd.repeat_interleave(HQ // HKV, dim=1)
    ve = vd.repeat_interleave(HQ // HKV, dim=1)

    def sdpa_expanded():
        return F.scaled_dot_product_attention(qd, ke, ve, attn_mask=mask, is_causal=causal)

    row["sdpa_gqa_us"] = median_us(sdpa_gqa)
    row["sdpa_expanded_us"] = median_us(sdpa_expanded)
    best_fn = sdpa_gqa if row["sdpa_gqa_us"] <= row["sdpa_expanded_us"] else sdpa_expanded
    best = min(row["sdpa_gqa_us"], row["sdpa_expanded_us"])
    row["speedup_vs_best_sdpa"] = best / row["triton_us"]
    row["triton_graph_us"] = graph_us(lambda: paged_attention(q, k_cache, v_cache, meta))
    row["sdpa_graph_us"] = graph_us(best_fn)
    kv_bytes = 2 * sum(c + q for c, q in zip(ctxs, qlens)) * HKV * D * 2
    row["triton_kv_GBps"] = kv_bytes / row["triton_us"] / 1e3
    if BACKEND.fuses(meta, HQ // HKV):
        fused = fused_step(q, k_cache, v_cache, meta, ctxs, qlens)
        row["fused_kernel"] = "decode" if meta.all_decode else "tree"
        row["fused_us"] = median_us(fused)
        row["fused_graph_us"] = graph_us(fused)
        row["fused_graph_speedup_vs_best_sdpa_graph"] = row["sdpa_graph_us"] / row["fused_graph_us"]
    return row


def fused_step(q, k_cache, v_cache, meta: AttentionMetadata, ctxs: list[int],
               qlens: list[int], num_splits: int | None = None,
               tile: tuple[int, int] | None = None):
    """The engine's fused call for the step: rotary on q and the new k, the new K/V written by
    slot, attention over the cache and the step's own rows (`num_splits`: None for
    `choose_num_splits`'s; `tile`: decode attention's (block_n, num_warps), None for its
    default), the decode kernel with programmatic dependent launch where SPECDEC_PDL=1."""
    t = sum(qlens)
    k = torch.randn(t, HKV, D, device=DEV, dtype=DT)
    v = torch.randn(t, HKV, D, device=DEV, dtype=DT)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctxs, qlens)]).to(DEV)
    # Each row's own slot, past its context (the cache's blocks hold them: build() sizes them).
    pos = positions.view(len(ctxs), -1)  # (the fused kernels take equal rows per sequence)
    blk = meta.block_tables.long().gather(1, pos // BS)
    meta.slot_mapping.copy_((blk * BS + pos % BS).flatten())
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D))
    scale = D ** -0.5
    splits = num_splits or choose_num_splits(meta, HQ, HKV, DEV)
    rope = BACKEND.step_rope(meta, positions, inv_freq, 1.0, HQ // HKV)
    pdl = runtime_from_env().pdl
    if tile is not None:
        from verify_kernels.decode_attention import decode_attention

        return lambda: decode_attention(q, k, v, positions, inv_freq, 1.0, k_cache, v_cache,
                                        meta, scale, splits, block_n=tile[0], num_warps=tile[1],
                                        pdl=pdl)
    return lambda: BACKEND.decode(q, k, v, positions, inv_freq, 1.0, k_cache, v_cache, meta,
                                  scale, splits, rope=rope, pdl=pdl)


def acceptance_case(bsz: int, nodes: int, vocab: int, g: torch.Generator) -> dict:
    trees, draft = [], []
    for _ in range(bsz):
        parents = random_parents(nodes, g)
        tokens = []
        for i, p in enumerate(parents):
            used = {t for t, pp in zip(tokens, parents[:i]) if pp == p}
            t = int(torch.randint(0, vocab, (1,), generator=g))
            while t in used:
                t = (t + 1) % vocab
            tokens.append(t)
        trees.append((tokens, parents))
        draft.append(torch.softmax(torch.randn(nodes, vocab, generator=g), -1))
    tree = DraftTree.from_lists(trees, draft, vocab)
    tree = DraftTree(tree.tokens.to(DEV), tree.parents.to(DEV), tree.depths, tree.offsets,
                     tree.draft_probs.to(DEV), tree.stochastic.to(DEV))
    probs = torch.softmax(torch.randn(bsz * (nodes + 1), vocab, device=DEV), -1)
    rows = torch.arange(bsz, device=DEV) * (nodes + 1)
    greedy = torch.zeros(bsz, dtype=torch.bool, device=DEV)
    nu = torch.rand(tree.num_nodes, device=DEV)
    bu = torch.rand(bsz, device=DEV)
    ws = torch.empty(bsz, vocab, device=DEV)
    out = accept_tree(probs, rows, tree, greedy, nu, bu, ws)
    ref = verify_tree(probs, rows, tree, greedy, nu, bu)
    row = {"case": "accept", "batch": bsz, "nodes": nodes, "vocab": vocab,
           "matches_reference": bool(torch.equal(out.tokens, ref.tokens)),
           "mean_accepted": float(ref.num_tokens.float().mean()) - 1}
    row["triton_us"] = median_us(lambda: accept_tree(probs, rows, tree, greedy, nu, bu, ws))
    row["torch_ref_us"] = median_us(lambda: verify_tree(probs, rows, tree, greedy, nu, bu))
    return row


def run_case(rows: list[dict], fn, *args) -> None:
    """Run one case; a failing case is recorded and the others still run."""
    try:
        rows.append(fn(*args))
    except Exception as e:  # one shot on a lent GPU: keep every other number
        rows.append({"case": "error", "args": repr(args)[:200], "error": repr(e)[:2000]})
    print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    for bsz in (1, 8, 32):
        for ctx in (1024, 4096, 8192):
            run_case(rows, attention_case, "decode", [ctx] * bsz, [1] * bsz, [None] * bsz, g)
    # (batch, nodes): one tree shape per case, so that the dense problem has one mask; 7 and
    # 15 nodes (8 and 16 rows with the root) at batch 1 and 4 are the fused tree kernel's.
    for bsz, nodes in ((1, 7), (1, 15), (4, 7), (4, 15), (4, 8), (4, 16), (4, 32), (4, 64)):
        tree = DraftTree.from_lists([(list(range(nodes)), random_parents(nodes, g))])
        run_case(rows, attention_case, "tree", [2048] * bsz, [nodes + 1] * bsz,
                 [tree.ancestor_mask(0)] * bsz, g)
    for ctx, q_len in ((0, 2048), (2048, 2048), (4096, 512)):
        run_case(rows, attention_case, "prefill", [ctx], [q_len], [None], g)
    for bsz in (8, 32):
        run_case(rows, acceptance_case, bsz, 16, 151936, g)
    info = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "layer": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS,
                  "dtype": "bfloat16"},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2))
    print(f"{'case':8} {'B':>3} {'q':>5} {'ctx':>5} {'triton_us':>10} {'sdpa_us':>10} "
          f"{'speedup':>8} {'splits':>6} {'nosplit_us':>10} {'GB/s':>7} {'tri_graph':>9} "
          f"{'sdpa_graph':>10} {'fused_graph':>11} {'x_sdpa':>6}")
    for r in rows:
        if r["case"] == "error":
            print(f"error    {r['args']}: {r['error'][:300]}")
            continue
        if r["case"] == "accept":
            print(f"accept   {r['batch']:>3} nodes={r['nodes']} V={r['vocab']} "
                  f"triton={r['triton_us']:.1f}us torch={r['torch_ref_us']:.1f}us "
                  f"match={r['matches_reference']} mean_accepted={r['mean_accepted']:.2f}")
            continue
        sdpa = min(r["sdpa_gqa_us"], r["sdpa_expanded_us"])
        print(f"{r['case']:8} {r['batch']:>3} {r['q_len']:>5} {r['context']:>5} "
              f"{r['triton_us']:>10.1f} {sdpa:>10.1f} {r['speedup_vs_best_sdpa']:>8.2f} "
              f"{r['num_splits']:>6} {r.get('triton_nosplit_us', float('nan')):>10.1f} "
              f"{r['triton_kv_GBps']:>7.0f} {r['triton_graph_us']:>9.1f} "
              f"{r['sdpa_graph_us']:>10.1f} {r.get('fused_graph_us', float('nan')):>11.1f} "
              f"{r.get('fused_graph_speedup_vs_best_sdpa_graph', float('nan')):>6.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
