"""Split-KV counts for decode attention at long contexts and large batches: the engine's fused
decode kernel (verify_kernels/decode_attention.py, with its merge) in a CUDA graph, per layer of
Llama-3.1-8B heads in bfloat16, over a grid of batch, context and split count, against SDPA on
the dense problem. `GraphRunner` fixes one split count per bucket (graph_tuning.heuristic_splits:
one split once batch x KV heads fills the SMs, e.g. batch 32); this shows what that leaves at
4k-8k tokens.

    PYTHONPATH=. python3 bench/investigations/gpu_decode_splits.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared helpers

from kernels_gpu import BS, DEV, DT, HKV, HQ, D, build, fused_step, graph_us


def sdpa_us(q: torch.Tensor, ctx: int) -> float:
    """SDPA of q [B, Hq, 1, D] over contiguous K/V of ctx + 1 columns, in a CUDA graph."""
    k = torch.randn(q.shape[0], HKV, ctx + 1, D, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    return graph_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--splits", default="1,2,3,4,6,8,16")
    ap.add_argument("--tiles", default="",
                    help="KV columns per tile x warps to time instead at the given splits, "
                         "e.g. 32x4,64x4,64x8,128x8 (decode_attention's block_n, num_warps)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    for bsz in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            meta, k_cache, v_cache = build([ctx] * bsz, [1] * bsz, [None] * bsz, g)
            q = torch.randn(bsz, HQ, D, device=DEV, dtype=DT)
            row = {"batch": bsz, "context": ctx, "fused_graph_us": {}}
            for s in map(int, args.splits.split(",")):
                if not args.tiles:
                    row["fused_graph_us"][s] = graph_us(fused_step(q, k_cache, v_cache, meta,
                                                                   [ctx] * bsz, [1] * bsz, s))
                    continue
                for tile in args.tiles.split(","):
                    bn, warps = map(int, tile.split("x"))
                    fn = fused_step(q, k_cache, v_cache, meta, [ctx] * bsz, [1] * bsz, s,
                                    tile=(bn, warps))
                    row["fused_graph_us"][f"{s}/{bn}x{warps}"] = graph_us(fn)
            row["sdpa_graph_us"] = sdpa_us(q.view(bsz, 1, HQ, D).transpose(1, 2), ctx)
            best = min(row["fused_graph_us"], key=row["fused_graph_us"].get)
            kv = 2 * bsz * (ctx + 1) * HKV * D * 2
            row["best_splits"] = best
            row["best_TBps"] = kv / row["fused_graph_us"][best] / 1e6
            first = next(iter(row["fused_graph_us"]))
            row["first_TBps"] = kv / row["fused_graph_us"][first] / 1e6
            row["sdpa_TBps"] = kv / row["sdpa_graph_us"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
            del k_cache, v_cache
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "layer": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS,
                      "dtype": "bfloat16"}, "results": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode_splits.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
