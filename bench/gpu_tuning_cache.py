"""The tuning cache on the GPU (specdec/graph_tuning.py, `cache_file`): a first process captures
the batch-1 buckets of 1, 2, 4 and 8 rows, timing split counts and tiles in the whole step, and
keeps its choices on disk; a second process of the same model shape loads them and captures the
same buckets without timing anything (Triton's compiled kernels are on disk by then too, as on
any restart). Each reports its capture time, what it chose or loaded, and the runner's step
time per bucket at batch 1 over a 1k context (so the first process also gives the batch-1 cost
curve at 2, 4 and 8 rows, LM head included, as bench/gpu_engine.py measures it).

    PYTHONPATH=. python3 bench/gpu_tuning_cache.py --out DIR [--model llama-3.1-8b-shape]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_setup as gs

ROWS = (1, 2, 4, 8)


def phase(model: str, cache: Path) -> dict:
    os.environ["SPECDEC_CACHE"] = str(cache)  # where the tuning cache lives (hub.cache_root)
    import torch

    # The tuning cache on, which the other benchmarks turn off.
    engine = gs.build_engine(gs.make_model_dir(Path(tempfile.mkdtemp()), model),
                             gs.check_triton(), num_blocks=200, tuning_cache=True)
    engine.runner.kv.normal_()
    runner = engine.runner.graphs
    tiles = engine.runner.model.kernels.tiles
    t0 = time.perf_counter()
    with torch.inference_mode():
        runner.capture_all(1, max(ROWS))
    capture_s = time.perf_counter() - t0
    steps = {str(n): gs.time_steps(engine, gs.step_segments(engine, 1, n, gs.CTX)) * 1e3
             for n in ROWS}
    return {
        "capture_all_s": capture_s,
        "cache_file": str(runner.cache),
        "loaded_buckets": sorted(map(list, runner.loaded)),
        "tuned": {str(k): v for k, v in runner.tuned.items()},
        "splits": {str(k): v for k, v in sorted(runner.splits.items())},
        "tiles": {str(k): list(v) for k, v in sorted(tiles.chosen_configs().items(), key=str)},
        "step_ms": steps,
        "cost_ratio": {n: v / steps["1"] for n, v in steps.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b-shape", choices=tuple(gs.SHAPES))
    # Internal: run one phase (its name) against the cache directory, in a process of its own.
    ap.add_argument("--phase", nargs=2, metavar=("NAME", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.phase is not None:
        name, cache = args.phase
        (out / f"phase_{name}.json").write_text(json.dumps(phase(args.model, Path(cache))))
        return
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp())
    report = gs.run_info()
    report.update({"model": args.model, "command": " ".join(["python3"] + sys.argv)})
    for name in ("first", "second"):
        subprocess.run([sys.executable, __file__, "--out", str(out), "--model", args.model,
                        "--phase", name, str(cache)], check=True)
        res = json.loads((out / f"phase_{name}.json").read_text())
        report[name] = res
        gs.log(f"{name}: capture_all {res['capture_all_s']:.1f} s, loaded "
               f"{res['loaded_buckets']}, splits {res['splits']}, step ms "
               + " ".join(f"{n}:{v:.3f}" for n, v in res["step_ms"].items()) + ", cost "
               + " ".join(f"{n}:{v:.3f}" for n, v in res["cost_ratio"].items()))
    a, b = report["first"], report["second"]
    report["same_choices"] = a["splits"] == b["splits"] and a["tiles"] == b["tiles"]
    gs.log(f"same splits and tiles: {report['same_choices']}; second start captured in "
           f"{b['capture_all_s']:.1f} s against {a['capture_all_s']:.1f}")
    (out / "gpu_tuning_cache.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
