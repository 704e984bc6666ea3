"""bench/goodput_cpu.py's configurations at batch 1, in its order on one engine, with what each
run cost in draft-model passes: the calls, their rows and seconds, and the request's steps,
drafted and accepted tokens. It asks whether a configuration that drafts little (`auto` on
ShareGPT) pays for its drafter all the same, or only reads slow with the machine's drift.

    PYTHONPATH=. python3 bench/investigations/cpu_goodput_calls.py [--dataset sharegpt]
        [--rounds 2] [--max-tokens 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import prompts as prompt_sets
from goodput_cpu import configs, run_batch

from specdec import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="sharegpt", choices=["humaneval", "sharegpt"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out")
    a = ap.parse_args()
    llm = LLM(model="qwen2.5-coder-1.5b", quantization="auto",
              speculative={"method": "draft_model", "draft_model": "qwen2.5-coder-0.5b"})
    llm.engine.load_default_drafter()
    llm.engine.calibrate_costs()
    tok = llm.tokenizer
    if a.dataset == "humaneval":
        text = prompt_sets.humaneval_texts(1)[0]
    else:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt_sets.sharegpt_texts(1)[0]}], tokenize=False,
            add_generation_prompt=True)
    ids = [tok.encode(text, add_special_tokens=False)[:512]]
    run_batch(llm, ids, {"method": "none"}, 4)  # warm-up, as the sweep does
    calls: list[tuple[int, float]] = []  # (rows, seconds) of each draft-model pass
    for d in llm.engine.drafting.drafters.values():
        runner = getattr(d, "runner", None)
        if runner is not None:
            def execute(segs, *args, _inner=runner.execute, **kw):
                t = time.perf_counter()
                out = _inner(segs, *args, **kw)
                calls.append((sum(len(s.tokens) for s in segs), time.perf_counter() - t))
                return out
            runner.execute = execute
    order = list(configs([2, 4], 4).items())
    runs = []
    for i in range(a.rounds):
        for name, spec in (order if i % 2 == 0 else order[::-1]):
            calls.clear()
            rate, _, ms = run_batch(llm, ids, spec, a.max_tokens)
            m = ms[0]
            run = {"round": i, "config": name, "tok_s": round(rate, 2), "draft_calls": len(calls),
                   "draft_rows": sum(c[0] for c in calls),
                   "draft_s": round(sum(c[1] for c in calls), 3),
                   "steps": m.steps if m else None, "drafted": m.draft_tokens if m else 0,
                   "accepted": m.accepted_tokens if m else 0}
            runs.append(run)
            print(json.dumps(run), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"dataset": a.dataset, "max_tokens": a.max_tokens,
                                           "date": time.strftime("%Y-%m-%d"), "runs": runs},
                                          indent=1))


if __name__ == "__main__":
    main()
