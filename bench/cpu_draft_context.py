"""How much of a sequence the draft model should read when it starts on one (its `context`
option): acceptance and speed against the context it is given, on this CPU, batch 1, greedy,
the presets (qwen2.5-coder-1.5b, its 0.5b draft model at a fixed depth).

For each prompt set and context the same prompts run one at a time. Reported per cell: tau
(tokens per target pass), the decode time after the first token (which includes the draft
model's read of the prompt: it happens at the first proposal), tokens per second over it, and
the speedup against plain decoding in the same run. Every output must equal plain decoding's.
`long` prompts are real code, this repository's own source files, cut to `--long-tokens`: what
an editor sends around the cursor.

    python bench/cpu_draft_context.py --contexts 64,128,256,512,0 \\
        --out bench/results/cpu_draft_context_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import prompts as prompt_sets
from cpu_decode import machine_info

from specdec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def long_prompts(tok: Any, n: int, tokens: int) -> list[list[int]]:
    files = sorted((ROOT / "specdec").glob("*.py"), key=lambda p: -p.stat().st_size)
    out = []
    for f in files:
        ids = tok.encode(f.read_text(), add_special_tokens=False)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == n:
            break
    return out


def run(llm: LLM, prompts: list[list[int]], spec: dict[str, Any], max_tokens: int
        ) -> dict[str, Any]:
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            speculative=spec)
    decode_s, tokens, steps, outs = 0.0, 0, 0, []
    for i, p in enumerate(prompts):
        rid = f"c{time.monotonic_ns()}-{i}"
        eng.add_request(rid, p, params)
        t_first, out = None, None
        while eng.has_unfinished():
            for o in eng.step():
                if t_first is None and o.token_ids:
                    t_first = time.perf_counter()
                out = o
        decode_s += time.perf_counter() - t_first
        tokens += len(out.token_ids) - 1
        steps += out.spec.steps if out.spec is not None else len(out.token_ids) - 1
        outs.append(list(out.token_ids))
    return {"decode_s": round(decode_s, 3), "tok_s": round(tokens / decode_s, 2),
            "tau": round(tokens / max(1, steps), 3), "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--datasets", default="humaneval,sharegpt,long")
    ap.add_argument("--prompts", type=int, default=6, help="per dataset")
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--contexts", default="64,128,256,512,0", help="0: the whole sequence")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    llm = LLM(model=a.model, quantization="auto",
              speculative={"method": "draft_model", "draft_model": a.draft})
    llm.engine.load_default_drafter()
    tok = llm.tokenizer
    import torch

    res: dict[str, Any] = {"machine": machine_info(torch.get_num_threads()),
                           "date": time.strftime("%Y-%m-%d"), "args": vars(a), "runs": [],
                           "mismatches": []}
    for ds in a.datasets.split(","):
        if ds == "long":
            prompts = long_prompts(tok, a.prompts, a.long_tokens)
        else:
            prompts = prompt_sets.load(ds, tok, a.prompts)
        run(llm, prompts[:1], {"method": "none"}, 4)  # warm-up
        plain = run(llm, prompts, {"method": "none"}, a.max_tokens)
        row: dict[str, Any] = {"dataset": ds, "prompt_tokens": [len(p) for p in prompts],
                               "plain": {k: v for k, v in plain.items() if k != "outputs"},
                               "contexts": {}}
        for c in [int(x) for x in a.contexts.split(",")]:
            spec = {"method": "draft_model", "num_speculative_tokens": a.k, "adaptive": False}
            if c:
                spec["context"] = c
            r = run(llm, prompts, spec, a.max_tokens)
            if r["outputs"] != plain["outputs"]:
                res["mismatches"].append(f"{ds} context={c}")
            r = {k: v for k, v in r.items() if k != "outputs"}
            r["vs_plain"] = round(r["tok_s"] / plain["tok_s"], 3)
            row["contexts"][str(c or "all")] = r
            print(ds, c or "all", json.dumps(r), flush=True)
        res["runs"].append(row)
        Path(a.out).write_text(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("mismatches", res["mismatches"])


if __name__ == "__main__":
    main()
