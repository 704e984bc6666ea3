"""A/B of the GPU step's switches, on one engine in one process: each configuration's graphs
are captured afresh (no in-graph tuning: SPECDEC_TUNE_GRAPHS=0, so every configuration gets
the tiles timed alone), then the runner's step is timed at 1 and 8 rows per sequence, batch 1,
1k context, the configurations alternated over several rounds (medians per configuration).

Switches: `embed` (specdec.models.llama.EMBED_HANDOFF_MIN_ROWS: 1, the embedding lookup hands
the first norm's input to the first qkv matmul at every row count, or past the few-row
matmul's 16, at none; the default since this was run is 2) and `logits`
(specdec.cuda_graphs.LOGITS_IN_GRAPH_TOKENS: 16 keeps the LM head of buckets of up to 16 rows
in the graph, 0 only of one-row buckets).

    PYTHONPATH=. python3 bench/gpu_ab.py --out DIR [--model llama-3.1-8b-shape]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("SPECDEC_TUNE_GRAPHS", "0")
os.environ.setdefault("SPECDEC_TUNING_CACHE", "0")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_setup as gs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b-shape", choices=tuple(gs.SHAPES))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import specdec.cuda_graphs as cg
    import specdec.models.llama as llama
    from verify_kernels import skinny_gemm

    out = gs.run_info()
    out.update({"model": args.model, "command": " ".join(["python3"] + sys.argv)})
    engine = gs.build_engine(gs.make_model_dir(Path(tempfile.mkdtemp()), args.model),
                             gs.check_triton(), num_blocks=200)
    engine.runner.kv.normal_()
    rows = [int(r) for r in args.rows.split(",")]
    segs = {n: gs.step_segments(engine, 1, n, gs.CTX) for n in rows}
    configs = [{"embed": e, "logits": lg} for e, lg in itertools.product((False, True), (0, 16))]
    times: dict[str, dict[int, list[float]]] = {}
    for rnd in range(args.rounds):
        for cfg in configs:
            llama.EMBED_HANDOFF_MIN_ROWS = 1 if cfg["embed"] else skinny_gemm.MAX_ROWS + 1
            cg.LOGITS_IN_GRAPH_TOKENS = cfg["logits"]
            engine.runner.graphs.graphs.clear()  # captured afresh under this configuration
            name = f"embed={int(cfg['embed'])} logits={cfg['logits']}"
            for n in rows:
                ms = gs.time_steps(engine, segs[n]) * 1e3
                times.setdefault(name, {}).setdefault(n, []).append(ms)
            gs.log(f"round {rnd} {name}: " + " ".join(
                f"{n}:{times[name][n][-1]:.3f}" for n in rows))
            torch.cuda.empty_cache()
    out["step_ms_median"] = {name: {str(n): statistics.median(v) for n, v in t.items()}
                             for name, t in times.items()}
    out["step_ms_rounds"] = {name: {str(n): v for n, v in t.items()} for name, t in times.items()}
    for name, t in out["step_ms_median"].items():
        ratio = (f" ratio {t[str(rows[-1])] / t[str(rows[0])]:.3f}" if len(rows) > 1 else "")
        gs.log(f"{name}: " + " ".join(f"{n}:{v:.3f}" for n, v in t.items()) + ratio)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_ab.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
