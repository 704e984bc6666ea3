"""EAGLE against n-gram lookup and a draft model: tau and speedup on the same target and prompts.

    python bench/eagle_bench.py --target smollm2-135m --sharegpt 10 --humaneval 10 \\
        --max-tokens 96 --threads 1
    python bench/eagle_bench.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --head DIR   # a head trained with `specdec train-drafter` for that target

Greedy, batch 1: every prompt runs alone, one request at a time, through each configuration's
engine in turn (all built first and warmed up), `--passes` times, each prompt's fastest run per
engine counting; speedup is the latency gain over plain decoding of the same target in the same
run. Per configuration: tau, acceptance per draft position, and the drafter's proposal time
per drafted token and per step. tau = new
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
        ("eagle chain k=3", {"method": "eagle", "num_speculative_tokens": 3, "top_k": 1,
                             **head}),
        (f"eagle tree d=5 k={args.top_k} n={args.max_nodes}",
         {"method": "eagle", "num_speculative_tokens": 5, "top_k": args.top_k,
          "max_nodes": args.max_nodes, **head}),
    ]
    return out


class Engine:
    """One configuration's engine, warmed up, with its drafter's proposal time counted."""

    def __init__(self, target: str, spec: dict[str, Any], adaptive: bool = False) -> None:
        from specdec import LLM, SamplingParams

        self.llm = LLM(model=target, speculative=spec,
                       adaptive_speculation=adaptive and spec["method"] != "none")
        self.method = spec["method"]
        self.llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8))
        self.llm.engine.spec_totals.clear()
        self.draft_s = 0.0
        if self.method != "none":
            drafting = self.llm.engine.drafting
            drafter = drafting.drafter(drafting.resolve(None))
            propose = drafter.propose

            def timed(batch: Any) -> Any:
                t = time.perf_counter()
                try:
                    return propose(batch)
                finally:
                    self.draft_s += time.perf_counter() - t

            drafter.propose = timed

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        from specdec import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate([prompt], SamplingParams(temperature=0.0,
                                                         max_tokens=max_tokens))[0]
        return out.token_ids, time.perf_counter() - t

    def summary(self) -> dict[str, Any]:
        totals = self.llm.engine.spec_totals.get(self.method)
        if totals is None or not totals.steps:
            return {"tau": 1.0}
        drafted = totals.drafted_per_position
        return {"tau": round(totals.tau, 3), "acceptance_rate": round(totals.acceptance_rate, 3),
                # P(position i accepted | drafted there), over every pass
                "accept_per_position": [round(a / max(1, d), 3) for a, d in
                                        zip(totals.accepted_per_position, drafted)],
                "draft_ms_per_token": round(1e3 * self.draft_s / max(1, totals.draft_tokens), 2),
                "draft_ms_per_step": round(1e3 * self.draft_s / totals.steps, 2)}


def compare(args: argparse.Namespace, chosen: list[tuple[str, dict[str, Any]]],
            prompts: list[list[int]]) -> dict[str, Any]:
    """Every prompt through every engine in turn, `--passes` times; each prompt's fastest
    time per engine counts (this machine's runs of one engine on one prompt differ by up to a
    third)."""
    engines = {label: Engine(args.target, spec, args.adaptive) for label, spec in chosen}
    best = {label: [float("inf")] * len(prompts) for label in engines}
    outputs: dict[str, list[list[int]]] = {label: [[] for _ in prompts] for label in engines}
    order = list(engines)
    for rnd in range(args.passes):
        for i, p in enumerate(prompts):
            turn = (rnd + i) % len(order)
            for label in order[turn:] + order[:turn]:
                toks, dt = engines[label].generate(p, args.max_tokens)
                best[label][i] = min(best[label][i], dt)
                outputs[label][i] = toks
    rows: dict[str, Any] = {}
    for label, e in engines.items():
        tokens = sum(len(o) for o in outputs[label])
        seconds = sum(best[label])
        rows[label] = {"tokens": tokens, "seconds": round(seconds, 3),
                       "tokens_per_s": round(tokens / seconds, 2), **e.summary(),
                       "greedy_equal": outputs[label] == outputs["plain"]}
        print(f"{label:28s} tau {rows[label]['tau']:.2f}  {rows[label]['tokens_per_s']:.1f} "
              f"tok/s", flush=True)
    for r in rows.values():
        r["speedup"] = round(r["tokens_per_s"] / rows["plain"]["tokens_per_s"], 3)
    return rows


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
    ap.add_argument("--passes", type=int, default=1, help="runs of each prompt per engine")
    ap.add_argument("--adaptive", action="store_true", help="the goodput controller chooses "
                    "each step's depth, up to each configuration's (as `specdec serve` does)")
    ap.add_argument("--only", default="", help="comma-separated starts of the config labels to run "
                    "(e.g. 'draft,eagle chain'); plain always runs")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/"
                    "eagle_<target>_<date>.json)")
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
                               "passes": args.passes, "adaptive": args.adaptive,
                               "date": datetime.date.today().isoformat(), "sets": {}}
    only = set(args.only.split(",")) - {""}
    chosen = [(label, spec) for label, spec in configs(args)
              if label == "plain" or not only or any(label.startswith(o) for o in only)]
    for name, prompts in sets.items():
        if prompts:
            print(f"{name}: {len(prompts)} prompts", flush=True)
            results["sets"][name] = {"prompts": len(prompts),
                                     "configs": compare(args, chosen, prompts)}
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().strftime("%Y%m%d")
    path = Path(args.out) if args.out else RESULTS / f"eagle_{args.target}_{stamp}.json"
    path.write_text(json.dumps(results, indent=2))
    print("\n| set | config | tau | tok/s | speedup | draft ms/token |\n|---|---|---|---|---|---|")
    for name, s in results["sets"].items():
        for label, r in s["configs"].items():
            print(f"| {name} | {label} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f} | {r.get('draft_ms_per_token', '')} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
