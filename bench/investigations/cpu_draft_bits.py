"""The draft model in 4 bits (its Q5_0 tensors requantized: `DRAFT_QUANTIZATION = "int4"`) against
the file's own 5 bits (q5, "auto"), in one process: two engines with the same target, each with
its default speculation, taking turns prompt by prompt (the order alternating by round), and
plain decoding on the first engine; per prompt and mode the fastest round, and tau.

    PYTHONPATH=. python3 bench/investigations/cpu_draft_bits.py [--dataset humaneval] \
        [--prompts 0,1,2,3,4,5] [--rounds 2] [--tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from prompts import inprocess_args, picked_texts

    ap = argparse.ArgumentParser()
    inprocess_args(ap)
    a = ap.parse_args()

    import drafters.draft_model as dm
    from specdec import LLM, SamplingParams

    picks, texts = picked_texts(a.dataset, a.prompts)
    engines = {}
    for name, quant in (("int4", "int4"), ("q5", "auto")):
        dm.DRAFT_QUANTIZATION = quant  # read when the engine builds its draft model
        engines[name] = LLM(model=a.model, quantization="auto", adaptive_speculation=True)
        engines[name].generate([texts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    modes = [("plain", "int4", {"method": "none"}), ("int4", "int4", None), ("q5", "q5", None)]
    res = {m: {"s": [], "tau": []} for m, _, _ in modes}
    for i in picks:
        best = {m: (float("inf"), 1.0) for m, _, _ in modes}
        for rnd in range(a.rounds):
            for m, eng, spec in (modes if rnd % 2 == 0 else modes[::-1]):
                llm = engines[eng]
                p = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                                   speculative=spec)
                t = time.perf_counter()
                out = llm.generate([texts[i]], p)[0]
                s = time.perf_counter() - t
                if s < best[m][0]:
                    best[m] = (s, out.spec.tau if out.spec is not None else 1.0)
        for m in res:
            res[m]["s"].append(round(best[m][0], 3))
            res[m]["tau"].append(round(best[m][1], 3))
        print(f"prompt {i}: " + " ".join(f"{m} {best[m][0]:.2f}s tau {best[m][1]:.2f}"
                                         for m in res), flush=True)
    plain = sum(res["plain"]["s"])
    summary = {m: {"total_s": round(sum(r["s"]), 2), "vs_plain": round(plain / sum(r["s"]), 3),
                   "mean_tau": round(sum(r["tau"]) / len(r["tau"]), 3)} for m, r in res.items()}
    print(json.dumps(summary))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "prompts": picks, "runs": res,
                                           "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
