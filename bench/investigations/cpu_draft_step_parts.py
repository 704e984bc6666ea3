"""Where a draft model's one-row step goes on the CPU: the C decoder layers, the output layer,
the rest of `ModelRunner.execute` (metadata, embedding, final norm: host work; the embedding
lookup and the final norm also on their own, and alone, back to back, for what the step's cold
caches add) and the greedy pick from the logits (the argmax, mapped back from a reduced draft
vocabulary), against the target's one-row step. Fastest and median of `--repeats` steps at a
300-token context.

    PYTHONPATH=. python3 bench/investigations/cpu_draft_step_parts.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from cpu_cost_curve import segment
from cpu_decode import machine_info

from specdec import LLM
from specdec.models.cpu_layers import CpuLayers
from specdec.sampler import argmax_rows


def timed(obj, name: str, log: list[float]):
    """Wrap obj.name so that each call's seconds are appended to log."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        log.append(time.perf_counter() - t)
        return out

    setattr(obj, name, wrapper)


def parts(runner, repeats: int, ids) -> dict[str, dict[str, float]]:
    layers: list[float] = []
    head: list[float] = []
    total: list[float] = []
    pick: list[float] = []
    embed: list[float] = []
    norm: list[float] = []
    model = runner.model
    timed(model, "compute_logits", head)
    timed(model.model.embed_tokens, "forward", embed)
    timed(model.model.norm, "forward", norm)
    original_run = CpuLayers.run

    def run(self, *a, **kw):
        t = time.perf_counter()
        original_run(self, *a, **kw)
        layers.append(time.perf_counter() - t)

    CpuLayers.run = run
    try:
        seg = segment(1)
        for _ in range(repeats):
            t = time.perf_counter()
            out = runner.execute(seg)
            total.append(time.perf_counter() - t)
            t = time.perf_counter()
            picked = argmax_rows(out.logits)
            if ids is not None:
                picked = ids[picked]
            picked.tolist()
            pick.append(time.perf_counter() - t)
    finally:
        CpuLayers.run = original_run
        del model.compute_logits, model.model.embed_tokens.forward, model.model.norm.forward
    # The same lookup and norm alone, back to back (warm caches): what they cost in a step
    # beyond that is their code and data coming back after the layers streamed the weights.
    tok = torch.tensor([100])
    hidden = torch.randn(1, model.model.norm.weight.numel())
    embed_alone, norm_alone = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        model.model.embed_tokens(tok)
        embed_alone.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.model.norm(hidden)
        norm_alone.append(time.perf_counter() - t)
    rest = [t - a - b for t, a, b in zip(total, layers, head)]
    res = {}
    for name, xs in (("execute", total), ("layers", layers), ("output_layer", head),
                     ("execute_rest", rest), ("embedding", embed), ("final_norm", norm),
                     ("embedding_alone", embed_alone), ("final_norm_alone", norm_alone),
                     ("logits_to_token", pick)):
        res[name] = {"best_ms": round(min(xs) * 1e3, 3),
                     "median_ms": round(statistics.median(xs) * 1e3, 3)}
    return res


def weight_bytes(model) -> dict[str, int]:
    from specdec.models.quant_linear import QuantLinear

    out = {"layers": 0, "output_layer": 0}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            n = sum(t.numel() * t.element_size() for p in m.parts
                    for t in (p.qs, p.d, p.mn) if t is not None)
            out["output_layer" if "lm_head" in name else "layers"] += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    llm = LLM(model=a.model, quantization="auto")
    eng = llm.engine
    draft = eng.drafting.drafter(eng.drafting.resolve(None))
    res = {"machine": machine_info(torch.get_num_threads()), "repeats": a.repeats,
           "date": time.strftime("%Y-%m-%d")}
    for name, runner, ids in (("draft", draft.runner, draft.head_ids),
                              ("target", eng.runner, None),
                              ("draft2", draft.runner, draft.head_ids)):
        p = parts(runner, a.repeats, ids)
        p["weight_bytes"] = weight_bytes(runner.model)
        res[name] = p
        print(name, json.dumps(p), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
