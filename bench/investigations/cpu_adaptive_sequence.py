"""The default adaptive speculation over a sequence of requests in one engine, as a fresh
`specdec serve` meets them: HumanEval prompts one after another (greedy, `--tokens` forced),
per request the draft tokens, accepted tokens, steps and seconds, and for the requests named by
`--trace` every step's chosen depth with the draft model's survival estimate S_1 .. S_k, its
catch-up (seconds) and whether it was behind. `--fade-all` lets a request's evidence fade while
it is kept plain even where the draft model is behind (the rule before d1560f4).

    PYTHONPATH=. python3 bench/investigations/cpu_adaptive_sequence.py [--prompts 12] \
        [--trace 0,6] [--fade-all] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trace", default="", help="prompt indices whose steps are logged")
    ap.add_argument("--fade-all", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()

    from prompts import humaneval_texts

    import specdec.spec_control as sc
    from specdec import LLM, SamplingParams

    if a.fade_all:
        survival = sc.SpeculationController.survival
        sc.SpeculationController.survival = (
            lambda self, rid, method, k, fade=True: survival(self, rid, method, k, True))
    llm = LLM(model=a.model, quantization="auto", adaptive_speculation=True)
    eng = llm.engine
    eng.load_default_drafter()
    eng.calibrate_costs()
    eng.warm_up()  # as the server does before it reports ready
    drafting = eng.drafting
    depths = drafting.depths
    trace: list[dict] = []

    def traced(decoding):
        depths(decoding)
        for r in decoding:
            alt = drafting._alternative(r, drafting._choices(r)[0])
            trace.append({"depth": r.depth, "survival": [round(x, 3) for x in alt.survival],
                          "catch_up_s": round(alt.catch_up, 4), "behind": alt.stale})

    traced_prompts = {int(x) for x in a.trace.split(",") if x}
    runs = []
    for i, text in enumerate(humaneval_texts(a.prompts)):
        drafting.depths = traced if i in traced_prompts else depths
        trace.clear()
        t = time.perf_counter()
        out = llm.generate([text], SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                                  ignore_eos=True))[0]
        s = out.spec
        rec = {"prompt": i, "seconds": round(time.perf_counter() - t, 3),
               "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
               "steps": s.steps}
        print(json.dumps(rec), flush=True)
        if i in traced_prompts:
            rec["trace"] = list(trace)
        runs.append(rec)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
