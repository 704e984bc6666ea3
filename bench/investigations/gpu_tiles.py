"""Tile candidates of the few-row matmul and variants of the tree attention kernel, each timed
as one Llama-3.1-8B layer's worth inside a CUDA graph of 32 layers (each layer its own weights
or KV, so nothing is served from L2 that a real step would read from memory).

1. Matmuls: each layer role (qkv with the norm handed on, o_proj writing the residual and the
   next norm's input, gated gate_up, down) at 1, 2, 4 and 8 rows, for every tile in
   skinny_tiles' candidates and in EXTRA_* below (FMA tiles at 2 rows only); per role and row
   count, sorted by time.
2. Tree attention at 2, 8 and 16 rows (batch 1, binary-tree mask, 1k context; the graph
   runner fuses up to tree_attention.MAX_Q rows; more take the two launches), and decode
   attention at 1: split counts, KV tile widths and warps, against rotary + KV write, paged
   attention and the merge as launches; from 8 rows also with each program's rows in row
   blocks ("r2", "r4": tree_attention's `row_blocks`). With --shape qwen2.5-7b-shape, its heads
   (28 query, 4 KV: 64 rows a program at 8 rows) at 1, 8 and 16 rows. The tree kernel's first
   split takes only the step's own columns, so S splits share the cached columns among S - 1
   programs: at 1k context and 64-column tiles, 9 and 17 splits give each busy program 2 and 1
   tiles, 8 and 16 give 3 and 2.

Earlier results: bench/results/gpu_tiles_h200_20261201.json (tree variants "alone" had the
step's own columns in a program of their own, the others in the last cached split, as before
2026-12-01), _prefetch.json (variants marked "prefetch" issued the next KV tile's loads before
the current tile's products, as the kernels now do; "rope/token" took rotary angles once per
query token: no faster, not kept).

    PYTHONPATH=. SPECDEC_SKINNY_TUNE=0 python3 bench/investigations/gpu_tiles.py --out DIR
    (--part matmuls --shape qwen2.5-7b-shape --rows 1 --one-row-all: every tile at one row
    on the Qwen2.5-7B shape)

SPECDEC_SKINNY_TUNE=0 skips timing each matmul shape's candidates on first use (every tile is
timed here anyway); SPECDEC_PDL=1 launches the matmuls and decode attention with programmatic
dependent launch (specdec.cli_options.runtime_from_env reads both).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers

import gpu_setup as gs
from gpu_decode_attn import HKV, HQ, LAYERS, D, graph_us

# (hidden, intermediate, q heads, kv heads) of the shapes the matmul part can take.
SHAPES = {"llama-3.1-8b-shape": (4096, 14336, HQ, HKV), "qwen2.5-7b-shape": (3584, 18944, 28, 4)}
# Tiles beyond skinny_tiles' candidates: narrow tensor-core tiles with deep pipelines (more
# programs, more bytes in flight per SM), and FMA tiles as long in K as the one-row ones.
EXTRA_DOT = ((16, 512, 4, 4, "dot"), (16, 1024, 4, 3, "dot"), (32, 512, 4, 4, "dot"),
             (32, 256, 4, 6, "dot"), (16, 256, 4, 6, "dot"), (32, 1024, 4, 2, "dot"),
             (64, 128, 4, 6, "swap"), (64, 64, 4, 8, "swap"), (64, 128, 4, 8, "swap"))
EXTRA_FMA = ((4, 1024, 4, 3, "fma"), (4, 512, 4, 3, "fma"), (8, 512, 4, 3, "fma"),
             (8, 1024, 8, 2, "fma"), (2, 1024, 4, 3, "fma"))
# Two-column FMA tiles with shorter K tiles (the products of 4-8 rows fit the registers), the
# shape that won every one-row matmul but qkv on the Qwen2.5-7B shape.
EXTRA_FMA_NARROW = ((2, 256, 4, 3, "fma"), (2, 512, 4, 3, "fma"))
ONE_ROW = {"qkv": (8, 1024, 4, 2, "fma"), "o_proj": (4, 1024, 4, 3, "fma"),
           "gate_up": (8, 1024, 4, 2, "fma"), "down": (4, 1024, 4, 3, "fma")}


def role_call(role: str, rows: int, tiles, shape: str = "llama-3.1-8b-shape"):
    """call(layer): the role's matmul at `rows` rows, with the prologue and epilogue the fused
    forward gives it, its tile looked up in `tiles` (a TileChoices)."""
    from verify_kernels.skinny_gemm import ScaledRows, residual_linear, skinny_linear

    pdl = gs.bench_runtime().pdl
    dev, dt = "cuda", torch.bfloat16
    hidden, inter, hq, hkv = SHAPES[shape]
    n, k = {"qkv": ((hq + 2 * hkv) * D, hidden), "o_proj": (hidden, hidden),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}[role]
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    g = torch.rand(k if role in ("qkv", "gate_up") else n, device=dev, dtype=dt) + 0.5
    x = torch.randn(rows, k, device=dev, dtype=dt)
    if role in ("qkv", "gate_up"):
        pre = ScaledRows(x * g, torch.rand(64, rows, device=dev) * k / 64)
        return lambda i: skinny_linear(x, ws[i], norm_weight=g, gated=role == "gate_up",
                                       prenormed=pre, tiles=tiles, pdl=pdl)
    res = torch.zeros(rows, n, device=dev, dtype=dt)
    return lambda i: residual_linear(x, ws[i], None, res, next_norm=g, tiles=tiles, pdl=pdl)


def matmuls(out: dict, save, shape: str, row_counts: tuple[int, ...],
            one_row_all: bool) -> None:
    """Per role and row count, every candidate tile. At one row the tile kept for the Llama
    shape alone, or with `one_row_all` every one-row FMA tile and every tensor-core tile (the
    16-row tile with 15 rows masked)."""
    from verify_kernels import skinny_tiles

    tiles = gs.tile_choices()  # each key's tile is set below before it is timed
    table = out.setdefault("matmul_us_per_layer", {})
    out["matmul_shape"] = shape
    for role in ("o_proj", "down", "qkv", "gate_up"):
        for rows in row_counts:
            call = role_call(role, rows, tiles, shape)
            with tiles.recording_keys() as keys:
                call(0)
            key = keys[0]
            if rows == 1 and one_row_all:
                cfgs = dict.fromkeys((ONE_ROW[role],) + skinny_tiles.CONFIGS_ONE_ROW + EXTRA_FMA
                                     + skinny_tiles.CONFIGS_DOT + skinny_tiles.CONFIGS_SWAP)
            elif rows == 1:
                cfgs = (ONE_ROW[role],)
            else:
                fma = (skinny_tiles.CONFIGS_FMA_ROWS + EXTRA_FMA if rows == 2 else ()) + (
                    EXTRA_FMA_NARROW if rows <= skinny_tiles.FMA_MAX_ROWS else ())
                cfgs = dict.fromkeys(skinny_tiles.CONFIGS_DOT + skinny_tiles.CONFIGS_SWAP
                                     + EXTRA_DOT + fma)
            times = {}
            for cfg in cfgs:
                tiles.set_config(key, cfg)
                try:
                    times[str(cfg)] = round(graph_us(call), 2)
                except Exception as e:  # a tile this GPU cannot fit
                    times[str(cfg)] = f"failed: {type(e).__name__}"
            ok = sorted((v, c) for c, v in times.items() if isinstance(v, float))
            table[f"{role} rows {rows}"] = dict([(c, v) for v, c in ok]
                                                + [(c, v) for c, v in times.items()
                                                   if not isinstance(v, float)])
            gs.log(f"{role} rows {rows}: " + ", ".join(f"{c} {v}" for v, c in ok[:5]))
            del call
            torch.cuda.empty_cache()
        save()


def attention_at(rows: int, hq: int = HQ, hkv: int = HKV, batch: int = 1) -> dict:
    """Per-layer microseconds of each variant at `rows` rows (1: the decode kernel), with `hq`
    query and `hkv` KV heads, for `batch` sequences (above 1: fewer splits, no row blocks)."""
    from gpu_verify_attn import tree_case

    from verify_kernels.decode_attention import decode_attention
    from verify_kernels.fused_ops import rope_write_kv
    from verify_kernels.paged_attention import paged_attention
    from verify_kernels.tree_attention import tree_attention

    qkv_of, caches, pos, inv, meta, slots = tree_case(batch, rows, hq, hkv)

    def two_launch(i, splits):
        q, k, v = qkv_of(i)
        rope_write_kv(q, k, v, pos, inv, 1.0, caches[i][0], caches[i][1], slots)
        paged_attention(q, caches[i][0], caches[i][1], meta, 0.088, num_splits=splits)

    kernel = (partial(decode_attention, pdl=gs.bench_runtime().pdl) if rows == 1
              else tree_attention)

    def fused(i, **kw):
        kernel(*qkv_of(i), pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088, **kw)

    row: dict = {}
    group = hq // hkv
    if batch > 1:  # B x KV heads x splits programs: a few splits fill the GPU
        tiles = tuple((x, 64, 8) for x in (1, 2, 3, 4, 5, 8, 9) if x > 1 or rows == 1)
    elif rows == 1:
        tiles = ((16, 32, 4), (32, 32, 4))
    elif hkv >= 8:
        tiles = ((4, 64, 8), (8, 64, 8), (9, 64, 8), (16, 64, 8), (17, 64, 8), (16, 32, 8),
                 (32, 32, 8))
    else:  # few KV heads (Qwen2.5-7B: 4): more splits to fill the GPU
        tiles = ((9, 64, 8), (16, 64, 8), (17, 64, 8), (17, 32, 8), (32, 32, 8), (33, 32, 8))
    for splits, bn, warps in tiles:
        if rows > 1 and bn == 64 and (batch == 1 or splits not in (3, 5, 9)):
            row[f"two_launch s{splits}"] = graph_us(lambda i, s=splits: two_launch(i, s))
        kw = {"num_splits": splits, "block_n": bn, "num_warps": warps}
        if batch == 1 or rows == 1 or splits in (2, 3, 5, 9):
            row[f"fused s{splits} n{bn} w{warps}"] = graph_us(lambda i, kw=kw: fused(i, **kw))
    if batch > 1:
        row["two_launch s1"] = graph_us(lambda i: two_launch(i, 1))
        return row
    # A program's rows (8 tokens x the group's heads, padded to a power of two) in row blocks
    # of 16 or more: 32 rows in 2 for Llama's 4 heads a group, 64 in 2 or 4 for Qwen's 7.
    blocks = rows * (1 << (group - 1).bit_length()) // 16 if rows >= 8 else 1
    variants = (((9, 64, 8), (9, 64, 4), (9, 32, 4), (16, 32, 4), (17, 32, 4), (32, 32, 4),
                 (32, 32, 8)) if hkv >= 8 else
                ((9, 64, 8), (17, 64, 8), (17, 64, 4), (17, 32, 4), (33, 32, 4)))
    for rb in (2, 4):
        if rb > blocks:
            break
        for splits, bn, warps in variants:
            kw = {"num_splits": splits, "block_n": bn, "num_warps": warps, "row_blocks": rb}
            row[f"fused s{splits} n{bn} w{warps} r{rb}"] = graph_us(
                lambda i, kw=kw: fused(i, **kw))
    return row


# Configurations that give each busy program one KV tile at 1k context (the kernels' 2-3 tiles a
# program cost ~1.9 us per extra 64-column tile at 2 and 8 rows in the runs above), each as
# (splits, tile columns, warps, row blocks, register cap or None), beside the ones kept.
WIDE = {
    1: ((32, 32, 4, 1, None), (33, 32, 4, 1, None), (17, 64, 4, 1, None), (17, 64, 8, 1, None),
        (9, 128, 4, 1, None), (9, 128, 8, 1, None)),
    2: ((9, 64, 8, 1, None), (16, 32, 8, 1, None), (9, 128, 8, 1, None), (9, 128, 4, 1, None),
        (17, 64, 4, 1, None), (17, 64, 8, 1, 128), (33, 32, 4, 1, None), (33, 32, 8, 1, 128),
        (17, 64, 4, 1, 128), (5, 256, 8, 1, None)),
    8: ((9, 64, 8, 1, None), (9, 128, 8, 1, None), (9, 128, 4, 1, None), (17, 64, 4, 1, None),
        (17, 64, 8, 1, 128), (33, 32, 4, 1, None), (33, 32, 8, 1, 128), (17, 32, 8, 1, 128),
        (9, 128, 4, 2, None), (17, 64, 4, 2, None), (17, 64, 4, 2, 128), (33, 32, 4, 2, None),
        (33, 32, 4, 2, 128), (9, 64, 8, 1, 128)),
}
WIDE_FEW_KV = {  # 4 KV heads (Qwen2.5-7B): rows 8 only
    1: ((32, 32, 4, 1, None), (33, 32, 4, 1, None), (17, 64, 4, 1, None), (17, 64, 8, 1, None)),
    8: ((9, 64, 8, 2, None), (9, 128, 8, 2, None), (9, 128, 4, 2, None), (9, 128, 4, 4, None),
        (17, 64, 4, 4, None), (17, 64, 8, 2, 128), (17, 64, 4, 2, None), (33, 32, 4, 4, None),
        (33, 32, 4, 4, 128), (33, 32, 8, 2, 128), (17, 64, 8, 2, None)),
}


def attention_wide_at(rows: int, hq: int = HQ, hkv: int = HKV) -> dict:
    """Per-layer microseconds of the WIDE configurations at `rows` rows (1: the decode kernel)."""
    from gpu_verify_attn import tree_case

    from verify_kernels.decode_attention import decode_attention
    from verify_kernels.tree_attention import tree_attention

    qkv_of, caches, pos, inv, meta, _ = tree_case(1, rows, hq, hkv)
    kernel = (partial(decode_attention, pdl=gs.bench_runtime().pdl) if rows == 1
              else tree_attention)
    row: dict = {}
    for splits, bn, warps, rb, cap in (WIDE if hkv >= 8 else WIDE_FEW_KV)[rows]:
        name = f"fused s{splits} n{bn} w{warps}" + (f" r{rb}" if rb > 1 else "") + (
            f" cap{cap}" if cap else "")
        kw = {"num_splits": splits, "block_n": bn, "num_warps": warps}
        if rows > 1:
            kw.update(row_blocks=rb, max_registers=cap)

        def call(i, kw=kw):
            kernel(*qkv_of(i), pos, inv, 1.0, caches[i][0], caches[i][1], meta, 0.088, **kw)
        try:
            row[name] = graph_us(call)
        except Exception as e:  # e.g. out of shared memory: say so and go on
            gs.log(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    return row


def attention_wide(out: dict, shape: str) -> None:
    hq, hkv = SHAPES[shape][2:]
    table = out.setdefault(f"wide_attention_us_per_layer {shape}", {})
    for rows in sorted(WIDE if hkv >= 8 else WIDE_FEW_KV):
        row = attention_wide_at(rows, hq, hkv)
        table[f"rows {rows}"] = dict(sorted((k, round(v, 2)) for k, v in row.items()))
        best = sorted(row.items(), key=lambda kv: kv[1])
        gs.log(f"wide rows {rows}: " + ", ".join(f"{k} {v:.2f}" for k, v in best))
        torch.cuda.empty_cache()


def attention(out: dict, shape: str, batch: int = 1) -> None:
    hq, hkv = SHAPES[shape][2:]
    llama = shape == "llama-3.1-8b-shape"
    table = out.setdefault("tree_attention_us_per_layer" + ("" if llama else f" {shape}")
                           + (f" batch {batch}" if batch > 1 else ""), {})
    sizes = (8, 16) if batch > 1 else (1, 2, 8, 16) if llama else (1, 8, 16)
    for rows in sizes:
        row = attention_at(rows, hq, hkv, batch)
        table[f"rows {rows}"] = dict(sorted((k, round(v, 2)) for k, v in row.items()))
        best = sorted(row.items(), key=lambda kv: kv[1])[:8]
        gs.log(f"attention rows {rows}: " + ", ".join(f"{k} {v:.2f}" for k, v in best))
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=("all", "matmuls", "attention", "wide"), default="all")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.1-8b-shape",
                    help="the model shape (matmuls: its layers; attention: its heads)")
    ap.add_argument("--rows", default="1,2,4,8", help="the matmul part's row counts")
    ap.add_argument("--batch", type=int, default=1,
                    help="the attention part's sequences (above 1: 8 and 16 rows each, split "
                         "counts for a full GPU, fused against two launches)")
    ap.add_argument("--one-row-all", action="store_true",
                    help="at one row, time every FMA and tensor-core tile, not the kept one")
    args = ap.parse_args()
    out = gs.run_info()
    dst = Path(args.out)
    dst.mkdir(parents=True, exist_ok=True)
    dst = dst / "gpu_tiles.json"
    if args.part in ("all", "attention"):
        attention(out, args.shape, args.batch)
        dst.write_text(json.dumps(out, indent=1))
    if args.part == "wide":
        attention_wide(out, args.shape)
        dst.write_text(json.dumps(out, indent=1))
    if args.part in ("all", "matmuls"):
        matmuls(out, lambda: dst.write_text(json.dumps(out, indent=1)), args.shape,
                tuple(int(r) for r in args.rows.split(",")), args.one_row_all)


if __name__ == "__main__":
    main()
