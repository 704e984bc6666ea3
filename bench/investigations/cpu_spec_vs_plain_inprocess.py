"""Speculative against plain decoding of the same prompts in one process, the two taking turns:
whether the default speculative configuration costs anything on prompts where it barely drafts
(a server run's per-prompt ratios move by 15% with the machine's neighbours). The first run of a
prompt reads it all and the second finds it in the prefix cache, so the order alternates by
round; compare rounds after the first. Per run: seconds,
and the draft model's passes and rows (its prompt read shows as one pass of up to its
`context`, 256 tokens).

    PYTHONPATH=. python3 bench/investigations/cpu_spec_vs_plain_inprocess.py \
        [--dataset sharegpt] [--prompts 3,4] [--rounds 2] [--tokens 128] [--out FILE]
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
    ap.add_argument("--dataset", default="sharegpt", choices=["humaneval", "sharegpt"])
    ap.add_argument("--prompts", default="3,4", help="indices into the dataset's prompts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()

    from prompts import picked_texts

    from specdec import LLM, SamplingParams

    picks, texts = picked_texts(a.dataset, a.prompts)
    llm = LLM(model=a.model, quantization="auto", adaptive_speculation=True)
    eng = llm.engine
    runner = eng.drafting.drafter(eng.drafting.resolve(None)).runner
    rows: list[int] = []
    execute = runner.execute

    def counted(segments, *args, **kw):
        rows.append(sum(len(s.tokens) for s in segments))
        return execute(segments, *args, **kw)

    runner.execute = counted
    llm.generate([texts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # first-use costs
    out = []
    for i in picks:
        prompt = llm.tokenizer.encode(texts[i])
        for rnd in range(a.rounds):
            for mode in ("plain", "spec") if rnd % 2 == 0 else ("spec", "plain"):
                rows.clear()
                p = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                                   speculative={"method": "none"} if mode == "plain" else None)
                t = time.perf_counter()
                llm.generate([prompt], p)
                rec = {"prompt": i, "prompt_tokens": len(prompt), "round": rnd, "mode": mode,
                       "seconds": round(time.perf_counter() - t, 3), "draft_passes": len(rows),
                       "draft_rows": sum(rows)}
                out.append(rec)
                print(json.dumps(rec), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "dataset": a.dataset,
                                           "tokens": a.tokens, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
