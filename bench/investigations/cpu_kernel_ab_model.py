"""A/B of builds of specdec/cpu_kernels/quant_matmul.c inside the engine, on the presets' real
weights: one process loads the target and its draft model once, then runs the same requests
under each build in turn (the engine's kernel library swapped between requests), and reports
per build the median and fastest time of a target pass by its row count and of a draft pass.
Greedy, forced length, batch 1, the default draft model at a fixed depth (`--k`, default 4:
verification passes of 5 rows) or none (`--k 0`: plain decoding, 1-row passes). Outputs must
not change with the build; the script says so if they do.

    PYTHONPATH=. python3 bench/investigations/cpu_kernel_ab_model.py \
        cur,specdec/cpu_kernels/quant_matmul.c new,/tmp/new.c,-DPREFETCH=8192 [--k 4]

A variant is NAME,SOURCE[,extra compiler flags...] as in cpu_matmul_ab.py, which compiles it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_matmul_ab import make
from prompts import inprocess_args, picked_texts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+", help="NAME,SOURCE[,flags...]")
    ap.add_argument("--k", type=int, default=4, help="draft depth (0: plain decoding)")
    inprocess_args(ap, prompts="0,1,2,3")
    a = ap.parse_args()
    import torch

    from specdec import LLM, SamplingParams
    from specdec.cpu_kernels import build

    libs = {}
    for spec in a.variants:
        name, src, *extra = spec.split(",")
        libs[name] = make(name, src, extra)
    current = {"lib": None}
    real = build.library

    def library(path: str):  # the variant under test for the AVX-512 paths
        return current["lib"] if current["lib"] is not None and path != "portable" \
            else real(path)

    picks, texts = picked_texts(a.dataset, a.prompts)
    spec = ({"method": "none"} if a.k == 0 else
            {"method": "draft_model", "num_speculative_tokens": a.k, "adaptive": False})
    llm = LLM(model=a.model, quantization="auto")
    torch.set_num_threads(2)
    build.library = library
    eng = llm.engine
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    now = {"variant": ""}

    def timed(runner, what: str) -> None:
        run = runner.execute

        def execute(segments, *args, **kw):
            t = time.perf_counter()
            out = run(segments, *args, **kw)
            rows = sum(len(s.tokens) for s in segments)
            times[now["variant"], f"{what} {rows} rows"].append(time.perf_counter() - t)
            return out
        runner.execute = execute

    timed(eng.runner, "target")
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                            speculative=spec)
    for lib in libs.values():  # every build warm, and the draft model loaded
        current["lib"] = lib
        llm.generate([texts[picks[0]]], SamplingParams(max_tokens=8, temperature=0.0,
                                                       speculative=spec))
    for d in eng.drafting.drafters.values():
        if getattr(d, "runner", None) is not None:
            timed(d.runner, "draft")
    times.clear()
    outputs: dict[tuple[str, int], list[int]] = {}
    for _ in range(a.rounds):
        for i in picks:
            for name, lib in libs.items():
                current["lib"], now["variant"] = lib, name
                out = llm.generate([texts[i]], params)[0].token_ids
                outputs.setdefault((name, i), list(out))
    same = all(outputs[n, i] == outputs[next(iter(libs)), i] for n in libs for i in picks)
    kinds = sorted({k for _, k in times}, key=lambda k: (k.split()[0], int(k.split()[1])))
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "model": a.model, "k": a.k, "prompts": picks, "rounds": a.rounds,
           "tokens": a.tokens, "outputs_equal": same, "variants": a.variants, "ms": {}}
    for kind in kinds:
        for name in libs:
            v = sorted(times[name, kind])
            if len(v) < 3:
                continue
            res["ms"].setdefault(kind, {})[name] = {
                "n": len(v), "median": round(statistics.median(v) * 1e3, 3),
                "best": round(v[0] * 1e3, 3)}
            print(f"{kind:18s} {name:8s} n {len(v):4d}  median {statistics.median(v) * 1e3:7.3f}"
                  f" ms  best {v[0] * 1e3:7.3f} ms")
    print("outputs equal across builds:", same)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
