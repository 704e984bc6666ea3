"""Where a lone request's decode step goes on the CPU with the presets: the target's passes, the
draft model's passes and the engine's host work by phase, plain decoding against the default
speculation (the preset's draft model), in one process, each prompt in turn both ways. Greedy,
forced length, batch 1, the same prompts as bench/cpu_vs_llamacpp.py (HumanEval). Per step:
milliseconds in each wrapped phase, summed over the prompts' decode steps (prefills left out)
and divided by their count; "host" is the step less the target's and the draft model's passes.

    PYTHONPATH=. python3 bench/investigations/cpu_host_b1.py [--prompts 0,1,2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_host_profile import wrap_timed
from host_phases import decode_steps, wrap_phases
from prompts import inprocess_args, picked_texts

# (attribute of the engine, method, name): the engine's phases; indented names are parts of
# the one above them
PHASES = [("committer", "commit", "commit"), ("drafting", "record", "  record"),
          ("drafting", "accepted", "  drafting.accepted"), ("drafting", "depths", "depths"),
          ("scheduler", "schedule", "schedule"), ("drafting", "propose", "propose"),
          ("runner", "execute", "target pass"), ("outputs", "build", "outputs")]


def main() -> None:
    ap = argparse.ArgumentParser()
    inprocess_args(ap, prompts="0,1,2")
    a = ap.parse_args()
    import specdec.engine as engine_module
    from specdec import LLM, SamplingParams

    picks, texts = picked_texts(a.dataset, a.prompts)
    llm = LLM(model=a.model, quantization="auto")
    eng = llm.engine
    acc: dict[str, float] = {}
    spec = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    plain = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                           speculative={"method": "none"})
    llm.generate([texts[picks[0]]], SamplingParams(max_tokens=8, temperature=0.0))  # builds it
    wrap_phases(eng, engine_module, PHASES, acc)
    for d in eng.drafting.drafters.values():
        if getattr(d, "runner", None) is not None:
            wrap_timed(d.runner, "execute", "  draft passes", acc)
    totals = {m: {"steps": 0, "s": 0.0, "parts": {}} for m in ("plain", "default")}
    for _ in range(a.rounds):
        for i in picks:
            for mode, params in (("plain", plain), ("default", spec)):
                eng.add_request(f"{mode}-{time.monotonic()}", texts[i], params)
                steps, seconds = decode_steps(eng, acc)
                tot = totals[mode]
                tot["steps"] += steps
                tot["s"] += seconds
                for k, v in acc.items():
                    tot["parts"][k] = tot["parts"].get(k, 0.0) + v
    res: dict = {"model": a.model, "dataset": a.dataset, "prompts": picks, "rounds": a.rounds,
                 "tokens": a.tokens, "modes": {}}
    for mode, tot in totals.items():
        n = max(1, tot["steps"])
        parts = {k: round(v / n * 1e3, 3) for k, v in
                 sorted(tot["parts"].items(), key=lambda x: -x[1])}
        step = tot["s"] / n * 1e3
        passes = parts.get("target pass", 0.0) + parts.get("  draft passes", 0.0)
        res["modes"][mode] = {"steps": tot["steps"], "ms_per_step": round(step, 3),
                              "host_ms_per_step": round(step - passes, 3),
                              "tokens_per_step": round(a.tokens * a.rounds * len(picks) / n, 3),
                              "phases_ms_per_step": parts}
        print(f"{mode}: {tot['steps']} steps, {step:.2f} ms a step "
              f"({res['modes'][mode]['tokens_per_step']} tokens), host {step - passes:.2f} ms")
        for k, v in parts.items():
            print(f"   {k:22s} {v:.3f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
