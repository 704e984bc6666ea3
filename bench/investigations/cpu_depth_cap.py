"""How deep the controller may draft (`num_speculative_tokens`, the cap of its per-step choice)
against plain decoding, in one process: the default speculation (the draft model, `p_min` and
the controller) with caps --caps, and plain, taking turns prompt by prompt, the order rotating
by round; per prompt and mode the fastest round. The draft model's passes cost about a fifth of
a target step here, so how far a confident chain may go decides how much a step can gain.

    PYTHONPATH=. python3 bench/investigations/cpu_depth_cap.py [--dataset humaneval] \
        [--prompts 0,1,2,3,4,5] [--caps 4,6,8] [--rounds 2] [--tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from prompts import inprocess_args, picked_texts

    ap = argparse.ArgumentParser()
    inprocess_args(ap)
    ap.add_argument("--caps", default="4,6,8")
    a = ap.parse_args()

    from specdec import LLM, SamplingParams

    picks, texts = picked_texts(a.dataset, a.prompts)
    llm = LLM(model=a.model, quantization="auto", adaptive_speculation=True)
    draft = llm.engine.default_spec.draft_model
    modes = {"plain": {"method": "none"}}
    for cap in map(int, a.caps.split(",")):
        modes[f"cap{cap}"] = {"method": "draft_model", "draft_model": draft,
                              "num_speculative_tokens": cap}
    llm.generate([texts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # first-use costs
    names = list(modes)
    res: dict[str, dict[str, list]] = {m: {"s": [], "tau": []} for m in names}
    outputs: dict[int, set] = {}
    for i in picks:
        prompt = llm.tokenizer.encode(texts[i])
        best = dict.fromkeys(names, float("inf"))
        tau = dict.fromkeys(names, 1.0)
        for rnd in range(a.rounds):
            for m in names[rnd % len(names):] + names[:rnd % len(names)]:
                p = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                                   speculative=modes[m])
                t = time.perf_counter()
                out = llm.generate([prompt], p)[0]
                s = time.perf_counter() - t
                outputs.setdefault(i, set()).add(tuple(out.token_ids))
                if s < best[m]:
                    best[m] = s
                    tau[m] = out.spec.tau if out.spec is not None else 1.0
        for m in names:
            res[m]["s"].append(round(best[m], 3))
            res[m]["tau"].append(round(float(tau[m]), 3))
        print(f"prompt {i}: " + " ".join(f"{m} {best[m]:.2f}s" for m in names), flush=True)
    plain = res["plain"]["s"]
    summary = {m: {"total_s": round(sum(r["s"]), 2),
                   "vs_plain": round(sum(plain) / sum(r["s"]), 3),
                   "per_prompt_vs_plain": [round(p / s, 3) for p, s in zip(plain, r["s"])],
                   "median_per_prompt": round(statistics.median(
                       p / s for p, s in zip(plain, r["s"])), 3)}
               for m, r in res.items()}
    for m, s in summary.items():
        print(f"{m}: {s['total_s']} s, {s['vs_plain']}x plain, per prompt "
              f"{s['per_prompt_vs_plain']}")
    same = all(len(v) == 1 for v in outputs.values())
    print("every mode's output equal:", same)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "prompts": picks, "runs": res,
                                           "summary": summary, "outputs_equal": same},
                                          indent=1))


if __name__ == "__main__":
    main()
