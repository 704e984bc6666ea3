"""Split-KV count per graph bucket, timed: each bucket captured with a fixed number of KV splits
and its replay timed, to check `GraphRunner.num_splits` (Llama-3.1-8B shape, random weights,
1k context, bf16). Tiles are not re-tuned per capture (SPECDEC_TUNE_GRAPHS=0): compare splits
within a bucket, not buckets with each other.

    PYTHONPATH=. python3 bench/gpu_splits.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("SPECDEC_TUNE_GRAPHS", "0")

import torch
from gpu_setup import CTX, NOTE, build_engine, check_triton, log, make_model_dir, step_segments


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--buckets", default="16x8,16x16,8x16,32x4,32x8,4x16,1x8")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    args = ap.parse_args()
    from specdec.cuda_graphs import GraphRunner
    from specdec.graph_tuning import replay_ms

    backend = check_triton()
    engine = build_engine(make_model_dir(Path(tempfile.mkdtemp()), "llama-3.1-8b-shape"),
                          backend, num_blocks=2600)
    engine.runner.kv.normal_()
    graphs = engine.runner.graphs
    default = GraphRunner.num_splits
    res: dict = {"note": NOTE, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "context_tokens": CTX, "buckets": {}}
    for spec in args.buckets.split(","):
        b, q = map(int, spec.split("x"))
        segs = step_segments(engine, b, q, CTX)
        row = {"heuristic": default(graphs, b, q)}
        for s in map(int, args.splits.split(",")):
            GraphRunner.num_splits = lambda self, b_, q_, s=s: s
            graphs.graphs.pop((b, q), None)
            engine.runner.execute(segs)  # captures the bucket with `s` splits
            graph, _ = graphs.graphs[(b, q)]
            row[str(s)] = replay_ms(graph, reps=20)
        GraphRunner.num_splits = default
        graphs.graphs.pop((b, q), None)
        res["buckets"][spec] = row
        log(f"bucket {spec}: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                           f"{k}={v}" for k, v in row.items()))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_splits.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
