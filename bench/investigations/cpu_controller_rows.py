"""What the draft-model controller pays for the rows it verifies, with the presets on this CPU, in
one process: (1) each drafted step of a fixed-k run, the target pass the controller would
predict at the rows asked (1 + k a sequence) and at the rows expected where the draft model stops
short (1 + D_1 + .. + D_k, `Alternative.rows`), against the pass measured; and the draft model's
proposal priced by the likeliest sequence's reach D_j and by the chance that any of the batch's
sequences drafts j deep (`depth_plan.union_reach`), against the proposal measured; (2)
speculation off, fixed k = 4, and the controller as it is and as it was before both (rows
asked, the likeliest reach), taking turns per prompt group over `--rounds` rounds (every other
one in reverse order), each configuration's fastest round per group kept, the geometric mean of
those against off. Its batch-1 run at 0438a5d compared rows asked and expected alone.

    PYTHONPATH=. python3 bench/investigations/cpu_controller_rows.py --out FILE.json \
        [--datasets humaneval,sharegpt] [--groups 6] [--batch 1] [--rounds 2] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from cpu_decode import machine_info
from goodput_cpu import run_batch
from prompts import load

import specdec.model_runner as model_runner
from specdec import LLM, depth_plan, spec_control
from specdec.depth_plan import union_reach

CONFIGS = {
    "off": {"method": "none"},
    "k=4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    "controller before": {"method": "draft_model", "num_speculative_tokens": 8,
                          "adaptive": True},
    "controller": {"method": "draft_model", "num_speculative_tokens": 8, "adaptive": True},
}


def rows_asked(self: depth_plan.Alternative, j: int) -> float:
    return float(self.width)


def likeliest(reaches: list[list[float]]) -> list[list[float]]:
    top = [max(col) for col in zip(*reaches)]
    return [top] * len(reaches)


def pass_check(llm: LLM, groups: list[list[list[int]]], tokens: int) -> dict:
    """Per drafted step of fixed k = 4: predicted passes at the rows asked and expected, and the
    pass measured (the target's `execute`), medians in ms."""
    eng = llm.engine
    ctl = eng.drafting.controller
    steps: list[tuple[float, float, float]] = []
    proposals: list[tuple[float, float, float]] = []
    execute = model_runner.ModelRunner.execute
    depths, propose = type(eng.drafting).depths, type(eng.drafting).propose
    pending: dict = {}

    def traced_depths(self, decoding):
        depths(self, decoding)
        drafting = [r for r in decoding if r.depth]
        pending.clear()
        if drafting:
            k, n = drafting[0].depth, len(drafting)
            reaches = [ctl.reach(r.request_id, "draft_model", k) for r in drafting]
            asked = len(decoding) + sum(r.depth for r in drafting)
            pending["asked"] = ctl.costs.pass_time(asked)
            pending["expected"] = ctl.costs.pass_time(len(decoding) + sum(map(sum, reaches)))
            likeliest = [max(col) for col in zip(*reaches)]
            pending["draft"] = (ctl.costs.draft.time("draft_model", n, k, likeliest),
                                ctl.costs.draft.time("draft_model", n, k,
                                                     union_reach(reaches)[-1]))

    def traced_propose(self, plan, requests):
        t = time.perf_counter()
        out = propose(self, plan, requests)
        if "draft" in pending:
            proposals.append((*pending["draft"], time.perf_counter() - t))
        return out

    def traced_execute(self, *a, **kw):
        t = time.perf_counter()
        out = execute(self, *a, **kw)
        if self is eng.runner and pending:
            steps.append((pending["asked"], pending["expected"], time.perf_counter() - t))
            pending.clear()
        return out

    type(eng.drafting).depths = traced_depths
    type(eng.drafting).propose = traced_propose
    model_runner.ModelRunner.execute = traced_execute
    try:
        for g in groups:
            run_batch(llm, g, CONFIGS["k=4"], tokens)
    finally:
        type(eng.drafting).depths, type(eng.drafting).propose = depths, propose
        model_runner.ModelRunner.execute = execute
    med = [round(statistics.median(s[i] for s in steps) * 1e3, 2) for i in range(3)]
    drf = [round(statistics.median(s[i] for s in proposals) * 1e3, 2) for i in range(3)]
    return {"steps": len(steps), "predicted_rows_asked_ms": med[0],
            "predicted_rows_expected_ms": med[1], "measured_ms": med[2],
            "draft_predicted_likeliest_ms": drf[0], "draft_predicted_any_ms": drf[1],
            "draft_measured_ms": drf[2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="humaneval,sharegpt")
    ap.add_argument("--groups", type=int, default=6, help="prompt groups a dataset")
    ap.add_argument("--batch", type=int, default=1, help="prompts a group, run as one batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    llm = LLM(model="qwen2.5-coder-1.5b", quantization="auto",
              speculative={"method": "draft_model", "draft_model": "qwen2.5-coder-0.5b"})
    llm.engine.load_default_drafter()
    llm.engine.calibrate_costs()
    res: dict = {"machine": machine_info(torch.get_num_threads()), "args": vars(a),
                 "datasets": {}}
    expected = depth_plan.Alternative.rows
    for ds in a.datasets.split(","):
        ids = [p[:512] for p in load(ds, llm.tokenizer, a.groups * a.batch)]
        groups = [ids[i * a.batch:(i + 1) * a.batch] for i in range(a.groups)]
        run_batch(llm, groups[0][:1], CONFIGS["off"], 4)  # warm-up
        out: dict = {"pass_check": pass_check(llm, groups, a.tokens), "tok_s": {}}
        for rnd in range(a.rounds):
            order = list(CONFIGS.items())
            for gi, g in enumerate(groups):
                for name, spec in (order if rnd % 2 == 0 else order[::-1]):
                    if name == "controller before":
                        depth_plan.Alternative.rows = rows_asked
                        spec_control.union_reach = likeliest
                    try:
                        rate, _, _ = run_batch(llm, g, spec, a.tokens)
                    finally:
                        depth_plan.Alternative.rows = expected
                        spec_control.union_reach = union_reach
                    best = out["tok_s"].setdefault(name, [0.0] * a.groups)
                    best[gi] = round(max(best[gi], rate), 2)
                    print(ds, rnd, gi, name, round(rate, 2), flush=True)
        off = out["tok_s"]["off"]
        out["vs_off"] = {n: round(statistics.geometric_mean(
            [v / o for v, o in zip(vs, off)]), 3) for n, vs in out["tok_s"].items()}
        res["datasets"][ds] = out
        print(ds, json.dumps(out["pass_check"]), json.dumps(out["vs_off"]), flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
