"""Where a decode step's GPU time goes, on the Llama-3.1-8B shape (random weights, bf16).

1. Every linear layer of the shape at 1, 4 and 16 rows: cuBLAS (`F.linear`) against
   `verify_kernels.skinny_gemm.skinny_linear` (tile sizes tuned per shape), as weight-read
   bandwidth, L2 cleared before each run (triton.testing.do_bench).
2. One eager decode step at batch 1 with a 1k context under torch.profiler: GPU time per kernel
   family, kernel count, and the sum against the step's wall time.

    PYTHONPATH=. python3 bench/gpu_step_profile.py --out DIR   (writes DIR/gpu_step_profile.json)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_setup as gs


def linear_bench(out: dict) -> None:
    from triton.testing import do_bench

    from verify_kernels.skinny_gemm import skinny_linear

    tiles = gs.tile_choices()  # kept across calls: each shape is tuned once
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336), "lm_head": (128256, 4096)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_cublas = do_bench(lambda x=x, w=w: F.linear(x, w), warmup=10, rep=50)
            skinny_linear(x, w, tiles=tiles)  # tunes
            t_ours = do_bench(lambda x=x, w=w: skinny_linear(x, w, tiles=tiles), warmup=10,
                              rep=50)
            gb = n * k * 2 / 1e9
            rows.append({"layer": name, "n": n, "k": k, "rows": m,
                         "cublas_us": t_cublas * 1e3, "skinny_us": t_ours * 1e3,
                         "cublas_tb_s": gb / t_cublas, "skinny_tb_s": gb / t_ours})
            gs.log(f"{name} m={m}: cuBLAS {t_cublas * 1e3:.1f} us ({gb / t_cublas:.2f} TB/s), "
                   f"skinny {t_ours * 1e3:.1f} us ({gb / t_ours:.2f} TB/s)")
    out["linear"] = rows
    out["skinny_configs"] = {str(k): v for k, v in tiles.chosen_configs().items()}


def family(name: str) -> str:
    for key in ("skinny", "paged_attn", "reduce", "rope_write_kv", "rms_norm", "silu",
                "gemm", "gemv", "nvjet", "cutlass", "index", "elementwise", "copy", "argmax"):
        if key in name.lower():
            return key
    return name[:40]


def kernel_profile(engine, segs, out: dict, tag: str) -> None:
    """GPU time per kernel family of one eager step (the graph runner set aside)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    for _ in range(3):
        engine.runner.execute(segs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.runner.execute(segs)
        torch.cuda.synchronize()
    fam: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            f = fam[family(e.name)]
            f[0] += e.device_time / 5
            f[1] += 1 / 5
    total = sum(v[0] for v in fam.values())
    by = {k: {"us": round(v[0], 1), "launches": round(v[1], 1)}
          for k, v in sorted(fam.items(), key=lambda kv: -kv[1][0])}
    out[f"eager_step_gpu_us_by_kernel{tag}"] = by
    out[f"eager_step_gpu_busy_us{tag}"] = total
    gs.log(f"eager step{tag}: {total:.0f} us of GPU time in "
           f"{sum(v[1] for v in fam.values()):.0f} launches")
    for k, v in list(by.items())[:12]:
        gs.log(f"  {k:40s} {v['us']:8.1f} us  {v['launches']:.0f} launches")
    engine.runner.graphs = graphs


def graphed(engine, rows: int) -> float:
    """Graphed step time in ms at batch 1 after re-capturing (kernel settings changed)."""
    engine.runner.graphs.graphs.clear()
    return gs.time_steps(engine, gs.step_segments(engine, 1, rows, gs.CTX), iters=40) * 1e3


def step_profile(out: dict) -> None:
    tmp = Path(tempfile.mkdtemp())
    engine = gs.build_engine(gs.make_model_dir(tmp, "llama-3.1-8b-shape"), "triton", 600)
    tiles = engine.runner.model.kernels.tiles  # the model's matmul tile choices
    engine.runner.kv.normal_()
    segs = gs.step_segments(engine, 1, 1, gs.CTX)
    kernel_profile(engine, segs, out, "")
    kernel_profile(engine, gs.step_segments(engine, 1, 8, gs.CTX), out, "_8_rows")
    gr = engine.runner.graphs
    for rows in (1, 8):
        out[f"graph_step_ms_rows_{rows}"] = gs.time_steps(
            engine, gs.step_segments(engine, 1, rows, gs.CTX), iters=40) * 1e3
        gs.log(f"graphed step, {rows} rows (runner.execute): "
               f"{out[f'graph_step_ms_rows_{rows}']:.3f} ms")
    out["graph_tuning"] = {str(k): v for k, v in gr.tuned.items()}
    # The model's tiles beside those of the per-layer comparison (its own choices).
    out["skinny_configs"] = {**out.get("skinny_configs", {}),
                             **{str(k): v for k, v in tiles.chosen_configs().items()}}
    gs.log(f"in-graph tile tuning: {gr.tuned}")
    # How much the tile choice moves from one tuning to the next: forget every choice, tune
    # again (alone, then in the graph), time again.
    for trial in range(1):
        tiles.forget()
        gr.tuned_keys.clear()
        for rows in (1, 8):
            out.setdefault(f"retuned_graph_step_ms_rows_{rows}", []).append(graphed(engine, rows))
        gs.log(f"retuned {trial}: {gr.tuned}")
    gr.graphs.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-linear", action="store_true", help="skip the per-layer comparison")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "note": gs.NOTE}
    if not args.skip_linear:
        linear_bench(out)
    (out_dir / "gpu_step_profile.json").write_text(json.dumps(out, indent=1))
    step_profile(out)
    (out_dir / "gpu_step_profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
