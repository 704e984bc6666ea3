"""Where to stop a draft model's chain by its own confidence (the drafter's `p_min`): per drafted
token of a fixed-depth run (greedy, the default CPU pair, the adaptive controller off), the draft
model's top probability and whether the target accepted the token; then, per threshold, what a
chain cut before its first token under the threshold would have yielded, in tokens per second
against plain decoding, and what one cut after that token (proposing it as its last, the
drafter's rule since 2026-12-07) would have, with this machine's pass costs (the target at 1 to
k + 1 rows and the draft at one row, the fastest of a few passes each) and `--host-ms` for a
drafted step's host work beyond its pass (5.4-5.8 ms in bench/results/
server_trace_20261206_run1_prompt5.jsonl's `spec_ms`; 1.9 ms in cpu_host_b1_20261207.json). A
chain cut before the token still pays the pass that found the draft unsure.

    PYTHONPATH=. python3 bench/investigations/cpu_draft_confidence.py --out FILE.json \
        [--datasets humaneval,sharegpt] [--prompts 12] [--k 6] [--chains EARLIER.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from cpu_cost_curve import fastest_ms
from cpu_decode import machine_info
from prompts import load

from drafters.draft_model import DraftModelDrafter
from specdec import LLM, SamplingParams

THRESHOLDS = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def record(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[tuple[float, bool]]]:
    """Per proposal, per depth: (the draft's top probability, accepted)."""
    eng = llm.engine
    drafter = eng.drafting.drafter(eng.drafting.resolve(None))
    passes: list[tuple[float, int]] = []
    proposals: dict[str, list[tuple[float, int]]] = {}
    out: list[list[tuple[float, bool]]] = []
    execute, propose, accepted = (drafter.runner.execute, DraftModelDrafter.propose,
                                  DraftModelDrafter.accepted)

    def timed_execute(segs, *a, **kw):
        res = execute(segs, *a, **kw)
        p = torch.softmax(res.logits.float(), dim=-1)[0]
        i = int(p.argmax())
        passes.append((float(p[i]), int(drafter.head_ids[i]) if drafter.head_ids is not None
                       else i))
        return res

    def spy_propose(self, batch):
        passes.clear()
        tree = propose(self, batch)
        proposals[batch[0].request_id] = list(passes)
        return tree

    def spy_accepted(self, rid, num, kept):
        chain = proposals.pop(rid, None)
        if chain is not None:
            m = 0
            while m < len(chain) and m < len(kept) and chain[m][1] == kept[m]:
                m += 1
            out.append([(p, j < m) for j, (p, _) in enumerate(chain)])
        return accepted(self, rid, num, kept)

    drafter.runner.execute = timed_execute
    DraftModelDrafter.propose, DraftModelDrafter.accepted = spy_propose, spy_accepted
    try:
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            llm.generate([p], sp)
    finally:
        drafter.runner.execute = execute
        DraftModelDrafter.propose, DraftModelDrafter.accepted = propose, accepted
    return out


def simulate(props: list[list[tuple[float, bool]]], k: int, target_ms: dict[int, float],
             draft_ms: float, host_ms: float, keep: bool = False) -> dict[str, float]:
    """Tokens per second against plain decoding, per threshold, chains cut at k: before their
    first token under the threshold, or (`keep`) after it, that token proposed as the last."""
    res = {}
    for t in THRESHOLDS:
        tokens = seconds = 0.0
        for chain in props:
            chain = chain[:k]
            d = next((j for j, (p, _) in enumerate(chain) if p < t), len(chain))
            passes = d + 1 if d < len(chain) else len(chain)
            if keep:
                d = passes
            acc = next((j for j, (_, a) in enumerate(chain[:d]) if not a), d)
            tokens += acc + 1
            seconds += passes * draft_ms + target_ms[d + 1] + (host_ms if d else 0.0)
        res[str(t)] = round(tokens / seconds * target_ms[1], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--datasets", default="humaneval,sharegpt")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--host-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--chains", help="a previous run's JSON: price its recorded chains again")
    a = ap.parse_args()
    llm = LLM(model="qwen2.5-coder-1.5b", quantization="auto", adaptive_speculation=False,
              speculative={"method": "draft_model", "draft_model": "qwen2.5-coder-0.5b",
                           "num_speculative_tokens": a.k, "p_min": 0.0})
    eng = llm.engine
    drafter = eng.drafting.drafter(eng.drafting.resolve(None))
    # The passes take turns, round by round, so that a slow spell of the machine falls on all
    # of them alike (timed one size after another, 1 row read 43 ms and 5 rows 49).
    best: dict[int, float] = {}
    for _ in range(a.rounds):
        for n in range(0, a.k + 2):  # 0: the draft model's one-row pass
            t = fastest_ms(drafter.runner if n == 0 else eng.runner, max(1, n), repeats=1)
            best[n] = min(best.get(n, t), t)
    draft_ms = best.pop(0)
    target_ms = best
    chains = json.loads(Path(a.chains).read_text())["datasets"] if a.chains else {}
    res = {"machine": machine_info(torch.get_num_threads()), "date": time.strftime("%Y-%m-%d"),
           "args": vars(a), "target_ms": target_ms, "draft_ms": draft_ms, "datasets": {}}
    for ds in a.datasets.split(","):
        props = chains[ds]["chains"] if ds in chains else \
            record(llm, load(ds, eng.tokenizer, a.prompts), a.tokens)
        by_depth = [[p for p, _ in (c[j] for c in props if len(c) > j)] for j in range(a.k)]
        res["datasets"][ds] = {
            "proposals": len(props),
            "accepted_by_depth": [sum(1 for c in props if len(c) > j and c[j][1])
                                  for j in range(a.k)],
            "drafted_by_depth": [len(x) for x in by_depth],
            "tokens_per_s_vs_plain": {str(k): simulate(props, k, target_ms, draft_ms, a.host_ms)
                                      for k in range(2, a.k + 1)},
            "keeping_the_unsure_token": {
                str(k): simulate(props, k, target_ms, draft_ms, a.host_ms, keep=True)
                for k in range(2, a.k + 1)},
            "chains": props,
        }
        for rule in ("tokens_per_s_vs_plain", "keeping_the_unsure_token"):
            print(ds, rule, json.dumps(res["datasets"][ds][rule]), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
