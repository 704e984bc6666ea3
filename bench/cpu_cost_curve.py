"""The cost of one forward pass by query rows on the CPU, target and draft model of a preset:
what a verification of k draft tokens (k + 1 rows) and a draft step cost against a plain
decode step. One segment of n rows at a 300-token context, fastest of 15 passes per size.

    python bench/cpu_cost_curve.py --out bench/results/cpu_cost_curve_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from cpu_decode import machine_info

from specdec import LLM
from specdec.step_inputs import Segment

ROWS = (1, 2, 3, 4, 5, 6, 8)


def segment(n: int, ctx: int = 300) -> list[Segment]:
    return [Segment(tokens=[100] * n, positions=list(range(ctx, ctx + n)),
                    slots=list(range(ctx, ctx + n)), context_len=ctx,
                    block_table=list(range((ctx + n) // 16 + 1)), logits_rows=tuple(range(n)))]


def fastest_ms(runner, n: int, repeats: int = 15) -> float:
    seg = segment(n)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        runner.execute(seg)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    a = ap.parse_args()
    llm = LLM(model=a.model, quantization="auto")
    eng = llm.engine
    draft = eng.drafting.drafter(eng.drafting.resolve(None))
    out: dict = {"model": a.model, "rows": list(ROWS),
                 "machine": machine_info(torch.get_num_threads())}
    for name, runner in (("target", eng.runner), ("draft", draft.runner)):
        ms = [fastest_ms(runner, n) for n in ROWS]
        out[name] = {"ms": ms, "vs_one_row": [m / ms[0] for m in ms]}
        print(name, " ".join(f"{n}:{m:.1f}ms({m / ms[0]:.2f}x)" for n, m in zip(ROWS, ms)))
    out["draft_step_vs_target_step"] = out["draft"]["ms"][0] / out["target"]["ms"][0]
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
