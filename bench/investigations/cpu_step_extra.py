"""What a drafted step costs beyond the target pass at its rows, as the controller measures it
(CostModel.record_pass: the step's time less its drafting, against the pass curve's price at
its rows), in one process with the default speculation: per row count, the median step, the
priced pass and their difference, and the spec_time(1) the plan then charges a drafted step.

    PYTHONPATH=. python3 bench/investigations/cpu_step_extra.py [--dataset sharegpt] \
        [--prompts 5,2] [--tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dataset", default="sharegpt", choices=["humaneval", "sharegpt"])
    ap.add_argument("--prompts", default="5,2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()

    from prompts import picked_texts

    from specdec import LLM, SamplingParams

    picks, texts = picked_texts(a.dataset, a.prompts)
    llm = LLM(model=a.model, quantization="auto", adaptive_speculation=True)
    costs = llm.engine.drafting.controller.costs
    seen: list[tuple[int, float, int, float]] = []  # rows, seconds, speculating, priced pass
    record = costs.record_pass

    def recorded(rows, seconds, speculating=0, chained=False, batch=0):
        seen.append((rows, seconds, speculating, costs.pass_time(rows)))
        return record(rows, seconds, speculating, chained, batch)

    costs.record_pass = recorded
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for i in picks:
        llm.generate([texts[i]], params)
    by_rows: dict[str, list[tuple[float, float]]] = {}
    for rows, sec, spec, priced in seen:
        by_rows.setdefault("plain" if not spec else str(rows), []).append((sec, priced))
    res = {"model": a.model, "dataset": a.dataset, "prompts": picks, "tokens": a.tokens,
           "steps_ms": {k: {"n": len(v),
                            "step": round(statistics.median(s for s, _ in v) * 1e3, 2),
                            "priced_pass": round(statistics.median(p for _, p in v) * 1e3, 2),
                            "extra": round(statistics.median(s - p for s, p in v) * 1e3, 2)}
                        for k, v in sorted(by_rows.items())},
           "spec_time_1_ms": round(costs.spec_time(1) * 1e3, 2),
           "pace": round(costs.speed, 3)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
