"""What a batch's decode steps spend outside the target's pass on the CPU, speculation off
against adaptive requests that the controller keeps plain: per configuration, taking turns for
`--rounds` rounds on the same prompts (HumanEval, greedy, `--batch` sequences), the decode
steps' wall time split into the target's `execute` calls, the drafter's `propose` and the
rest (scheduling, the controller's plan, verification, commits: host work), and how many steps
were chained (`specdec/chaining.py`), and the draft depths its steps verified. `draft_model_k2`
is the draft model at a fixed depth of 2, for comparison.

    PYTHONPATH=. python3 bench/investigations/cpu_batch_host.py --batch 16 --rounds 3 \
        [--configs off,ngram,draft_model] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = {
    "off": {"method": "none"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": True},
    "auto": {"method": "auto", "num_speculative_tokens": 4},
    "draft_model_k2": {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="off,ngram,draft_model")
    ap.add_argument("--out")
    a = ap.parse_args()

    from prompts import humaneval_texts

    from specdec import LLM, SamplingParams

    llm = LLM(model=a.model, quantization="auto",
              speculative={"method": "draft_model", "draft_model": "qwen2.5-coder-0.5b"})
    eng = llm.engine
    eng.load_default_drafter()
    eng.calibrate_costs()
    prompts = [llm.tokenizer.encode(t) for t in humaneval_texts(a.batch)]
    spent = {"execute": 0.0, "propose": 0.0}
    execute, propose = eng.runner.execute, eng.drafting.propose

    def timed(fn, key: str):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    eng.runner.execute = timed(execute, "execute")
    eng.drafting.propose = timed(propose, "propose")
    runs: dict[str, list[dict]] = {c: [] for c in a.configs.split(",")}
    for rnd in range(a.rounds):
        for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                                    speculative=CONFIGS[name])
            for i, p in enumerate(prompts):
                eng.add_request(f"{name}{rnd}-{i}", p, params)
            rec = {"round": rnd, "execute_s": 0.0, "propose_s": 0.0, "decode_steps": 0,
                   "decode_s": 0.0}
            chained0 = eng.chainer.chained_steps
            depths0 = {m: dict(st.depths) for m, st in eng.drafting.controller.stats.items()}
            emitted = 0
            while eng.has_unfinished():
                prefill = any(s.in_prefill for s in eng.scheduler.running) \
                    or bool(eng.scheduler.waiting)
                spent["execute"] = spent["propose"] = 0.0
                t = time.perf_counter()
                outs = eng.step()
                dt = time.perf_counter() - t
                if not prefill:  # decode steps only: prefill is the same work in every config
                    rec["decode_steps"] += 1
                    rec["decode_s"] += dt
                    rec["execute_s"] += spent["execute"]
                    rec["propose_s"] += spent["propose"]
                    emitted += sum(len(o.delta_token_ids) for o in outs)
            t_decode, decode_steps = rec["decode_s"], rec["decode_steps"]
            rec.update(decode_s=round(t_decode, 3),
                       tok_s=round(emitted / t_decode, 2) if t_decode else 0.0,
                       chained=eng.chainer.chained_steps - chained0)
            # the depths the steps of this run verified (fixed ones included), per drafter
            rec["depths"] = {m: {k: n - depths0.get(m, {}).get(k, 0)
                                 for k, n in sorted(st.depths.items())
                                 if n > depths0.get(m, {}).get(k, 0)}
                             for m, st in eng.drafting.controller.stats.items()}
            runs[name].append(rec)
            rec["host_s"] = round(t_decode - rec["execute_s"] - rec["propose_s"], 3)
            rec["host_ms_per_step"] = round(rec["host_s"] / max(1, decode_steps) * 1e3, 2)
            rec["execute_s"], rec["propose_s"] = (round(rec["execute_s"], 3),
                                                  round(rec["propose_s"], 3))
            print(name, json.dumps(rec), flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs)
                      for k in ("tok_s", "host_ms_per_step", "decode_s", "execute_s")}
               for name, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs, "median": summary},
                                          indent=1))


if __name__ == "__main__":
    main()
