"""EAGLE against n-gram lookup and a draft model: tau and speedup on the same target and prompts.

    python bench/eagle_bench.py --target smollm2-135m --sharegpt 10 --humaneval 10 \\
        --max-tokens 96 --threads 1
    python bench/eagle_bench.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --head DIR   # a head trained with `specdec train-drafter` for that target

Greedy, batch 1: every prompt runs alone, one request at a time, after a warm-up request, so
speedup is the latency gain over plain decoding of the same engine in the same run. tau = new
tokens per target pass (the bonus token included). ShareGPT prompts are the first records, which
`train-drafter` leaves out of training (`--skip`). Writes bench/results/eagle_<target>_<date>.json
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import prompts as prompt_sets

RESULTS = Path(__file__).resolve().parent / "results"


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    head = {"eagle_head": args.head} if args.head else {}
    out: list[tuple[str, dict[str, Any]]] = [
        ("plain", {"method": "none"}),
        ("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4}),
    ]
    if args.draft:
        out.append(("draft k=4", {"method": "draft_model", "draft_model": args.draft,
                                  "num_speculative_tokens": 4}))
    out += [
        ("eagle chain k=4", {"method": "eagle", "num_speculative_tokens": 4, "top_k": 1,
                             **head}),
        (f"eagle tree d=5 k={args.top_k} n={args.max_nodes}",
         {"method": "eagle", "num_speculative_tokens": 5, "top_k": args.top_k,
          "max_nodes": args.max_nodes, **head}),
    ]
    return out


def run(target: str, spec: dict[str, Any], prompts: list[list[int]], max_tokens: int
        ) -> dict[str, Any]:
    from specdec import LLM, SamplingParams

    llm = LLM(model=target, speculative=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    llm.engine.spec_totals.clear()
    tokens, seconds = 0, 0.0
    outputs = []
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    totals = llm.engine.spec_totals.get(spec["method"])
    return {"tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "tau": round(totals.tau, 3) if totals else 1.0,
            "acceptance_rate": round(totals.acceptance_rate, 3) if totals else None,
            "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="a draft-model preset to compare too")
    ap.add_argument("--head", default=None, help="EAGLE head dir (default: the shipped one)")
    ap.add_argument("--sharegpt", type=int, default=10)
    ap.add_argument("--humaneval", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated starts of the config labels to run "
                    "(e.g. 'draft,eagle chain'); plain always runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from specdec.config import ModelConfig, resolve_model_config

    tok = AutoTokenizer.from_pretrained(resolve_model_config(ModelConfig(model=args.target)).path)
    # A set of 0 prompts is not loaded: finding no ShareGPT record reads the whole file.
    sets = {name: prompt_sets.load(name, tok, n) if n else []
            for name, n in (("sharegpt", args.sharegpt), ("humaneval", args.humaneval))}
    results: dict[str, Any] = {"target": args.target, "draft": args.draft, "head": args.head,
                               "max_tokens": args.max_tokens, "threads": args.threads,
                               "date": datetime.date.today().isoformat(), "sets": {}}
    for name, prompts in sets.items():
        if not prompts:
            continue
        rows: dict[str, Any] = {}
        only = set(args.only.split(",")) - {""}
        for label, spec in configs(args):
            if only and label != "plain" and not any(label.startswith(o) for o in only):
                continue
            r = run(args.target, spec, prompts, args.max_tokens)
            rows[label] = r
            print(f"{name:9s} {label:28s} tau {r['tau']:.2f}  {r['tokens_per_s']:.1f} tok/s",
                  flush=True)
        base = rows["plain"]
        base_out = base["outputs"]
        for r in rows.values():
            r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["greedy_equal"] = r.pop("outputs") == base_out
        results["sets"][name] = {"prompts": len(prompts), "configs": rows}
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().strftime("%Y%m%d")
    path = RESULTS / f"eagle_{args.target}_{stamp}.json"
    path.write_text(json.dumps(results, indent=2))
    print("\n| set | config | tau | tok/s | speedup |\n|---|---|---|---|---|")
    for name, s in results["sets"].items():
        for label, r in s["configs"].items():
            print(f"| {name} | {label} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
