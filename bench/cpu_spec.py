"""Speculative decoding on the CPU: qwen2.5-coder-1.5b with the qwen2.5-coder-0.5b draft model and
with n-gram lookup, greedy and at temperature 0.7, against transformers' assisted generation
(`assistant_model=`, `prompt_lookup_num_tokens=`) on the same prompts and settings, batch 1.

    python bench/cpu_spec.py --humaneval 4 --sharegpt 3 --max-tokens 64 \\
        --temperatures 0,0.7 --ours-draft 4:1,7:1 --ours-ngram 4:2 --hf-k 4 --threads 2

N-gram and prompt lookup run greedy only unless --sampled-lookup. Each configuration runs
every prompt once, one request at a time, after a warm-up; tokens/s is all new tokens over all
request times (prefill included, the same on both sides). Speedup is against the same engine's
plain decoding in this run. tau = new tokens per target forward pass (transformers: counted
with a forward hook). The two engines run in turn, not together, so that only one copy of the
models is in memory. Also measured: the cost of our target pass over q rows relative to one
row (the verification cost ratio). Writes
bench/results/cpu_spec_<date>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import prompts as prompt_sets
from cpu_decode import hf_generation_config, log, machine_info

RESULTS = Path(__file__).resolve().parent / "results"


def parse_pairs(s: str) -> list[tuple[int, int]]:
    """"4:1,7:1" -> [(k, branches), ...]."""
    out = []
    for part in s.split(","):
        if part:
            k, _, b = part.partition(":")
            out.append((int(k), int(b or 1)))
    return out


# ---- specdec -----------------------------------------------------------------------------

def ours_configs(args: argparse.Namespace, temp: float) -> list[tuple[str, dict[str, Any]]]:
    cfgs: list[tuple[str, dict[str, Any]]] = [("plain", {"method": "none"})]
    for k, b in args.ours_draft:
        cfgs.append((f"draft k={k} b={b}", {"method": "draft_model", "draft_model": args.draft,
                                            "num_speculative_tokens": k, "branches": b}))
        # The same drafter under the engine's draft-length controller (specdec.spec_control).
        cfgs.append((f"draft k={k} b={b} adaptive", {
            "method": "draft_model", "draft_model": args.draft, "num_speculative_tokens": k,
            "branches": b, "adaptive": True}))
    for k, b in args.ours_ngram if temp == 0 or args.sampled_lookup else []:
        cfgs.append((f"ngram k={k} b={b}", {"method": "ngram", "num_speculative_tokens": k,
                                            "branches": b}))
    return cfgs


def run_ours(args: argparse.Namespace, sets: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    from specdec import LLM, SamplingParams

    llm = LLM(model=args.target, dtype=args.dtype, device="cpu",
              speculative={"method": "none"}, cpu_kv_bytes=args.kv_mib << 20,
              enable_prefix_caching=False)
    rows = []
    for temp in args.temperatures:
        for label, spec in ours_configs(args, temp):
            params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0,
                                    ignore_eos=True, speculative=spec)
            warm = SamplingParams(temperature=temp, max_tokens=8, seed=0, ignore_eos=True,
                                  speculative=spec)
            llm.generate([sets["humaneval"][0]], warm)
            for kind, batch in sets.items():
                times, toks, steps, emitted, outs = [], 0, 0, 0, []
                for ids in batch:
                    t = time.perf_counter()
                    o = llm.generate([ids], params)[0]
                    times.append(time.perf_counter() - t)
                    toks += len(o.token_ids)
                    outs.append(o.token_ids)
                    if o.spec is not None:
                        steps += o.spec.steps
                        emitted += o.spec.emitted_tokens
                rows.append({"engine": "specdec", "config": label, "spec": spec,
                             "temperature": temp, "prompts": kind, "tokens": toks,
                             "seconds": round(sum(times), 3),
                             "tok_s": round(toks / sum(times), 3),
                             "tau": round(emitted / steps, 3) if steps else 1.0,
                             "outputs": outs, "loadavg": os.getloadavg()[0]})
                log(f"specdec T={temp} {label:16s} {kind:9s} {rows[-1]['tok_s']:6.2f} tok/s "
                    f"tau {rows[-1]['tau']:.2f}")
    verify = verify_cost(llm, args)
    del llm
    gc.collect()
    return rows, verify


@torch.inference_mode()
def verify_cost(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Milliseconds of one target pass over q new rows after a 256-token context, and of the
    draft model's; the ratio to q = 1 is what verifying q - 1 draft tokens costs in decode
    steps. Runs last: it writes KV blocks that no request owns any more."""
    from specdec.step_inputs import Segment

    out: dict[str, Any] = {}
    runners = {"target": llm.engine.runner}
    for (method, _draft), drafter in llm.engine.drafting.drafters.items():
        if method == "draft_model":
            runners["draft"] = drafter.runner
    for name, runner in runners.items():
        bs, ctx = runner.block_size, 256
        ms = {}
        for q in (1, 2, 3, 4, 5, 8, 9, 16):
            n = ctx + q
            table = list(range(-(-n // bs)))
            seg = Segment(tokens=[100] * q, positions=list(range(ctx, n)),
                          slots=list(range(ctx, n)), context_len=ctx, block_table=table,
                          logits_rows=tuple(range(q)))
            runner.execute([seg])
            ts = []
            for _ in range(args.probe_reps):
                t = time.perf_counter()
                runner.execute([seg])
                ts.append(time.perf_counter() - t)
            ms[q] = statistics.median(ts) * 1e3
        out[name] = {"ms": {str(q): round(v, 2) for q, v in ms.items()},
                     "ratio_to_1": {str(q): round(v / ms[1], 2) for q, v in ms.items()}}
        log(f"verify cost {name}: " + ", ".join(f"q={q} {v / ms[1]:.2f}x" for q, v in ms.items()))
    return out


# ---- transformers ------------------------------------------------------------------------

def hf_configs(args: argparse.Namespace, temp: float) -> list[tuple[str, dict[str, Any]]]:
    cfgs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    cfgs.append(("assisted default", {"assistant": True}))
    for k in args.hf_k:
        cfgs.append((f"assisted k={k}", {"assistant": True, "num_assistant_tokens": k,
                                         "num_assistant_tokens_schedule": "constant",
                                         "assistant_confidence_threshold": 0.0}))
    for k in args.hf_lookup if temp == 0 or args.sampled_lookup else []:
        cfgs.append((f"prompt lookup k={k}", {"prompt_lookup_num_tokens": k}))
    return cfgs


def run_hf(args: argparse.Namespace, sets: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.hub import resolve_model_path

    dtype = getattr(torch, args.dtype)
    tpath = resolve_model_path(args.target)
    tok = AutoTokenizer.from_pretrained(tpath)
    target = AutoModelForCausalLM.from_pretrained(tpath, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.draft),
                                                 dtype=dtype).eval()
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    rows = []
    for temp in args.temperatures:
        sampling = ({"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0}
                    if temp > 0 else {})
        for label, cfg in hf_configs(args, temp):
            cfg = dict(cfg)
            use_assistant = cfg.pop("assistant", False)
            extra = {"assistant_model": draft} if use_assistant else {}
            for kind, batch in sets.items():
                times, toks, passes, outs = [], 0, 0, []
                for i, ids in enumerate([batch[0]] + batch):  # the first one warms up
                    gc_ = hf_generation_config(tok, args.max_tokens if i else 8, **cfg)
                    for key, v in sampling.items():
                        setattr(gc_, key, v)
                    x = torch.tensor([ids])
                    torch.manual_seed(0)
                    calls[0] = 0
                    t = time.perf_counter()
                    with torch.inference_mode():
                        y = target.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                            generation_config=gc_, **extra)
                    dt = time.perf_counter() - t
                    if i == 0:
                        continue
                    new = y[0, x.shape[1]:].tolist()
                    times.append(dt)
                    toks += len(new)
                    passes += calls[0]
                    outs.append(new)
                rows.append({"engine": "transformers", "config": label, "settings": cfg,
                             "temperature": temp, "prompts": kind, "tokens": toks,
                             "seconds": round(sum(times), 3),
                             "tok_s": round(toks / sum(times), 3),
                             "tau": round(toks / passes, 3) if passes else 1.0,
                             "outputs": outs, "loadavg": os.getloadavg()[0]})
                log(f"transformers T={temp} {label:20s} {kind:9s} {rows[-1]['tok_s']:6.2f} "
                    f"tok/s tau {rows[-1]['tau']:.2f}")
    del target, draft
    gc.collect()
    return rows


# ---- report ------------------------------------------------------------------------------

def add_speedups(rows: list[dict[str, Any]]) -> None:
    base = {(r["engine"], r["temperature"], r["prompts"]): r["tok_s"] for r in rows
            if r["config"] == "plain"}
    for r in rows:
        r["speedup"] = round(r["tok_s"] / base[(r["engine"], r["temperature"], r["prompts"])], 3)
        plain = [p for p in rows if p["config"] == "plain" and p["engine"] == r["engine"]
                 and p["temperature"] == r["temperature"] and p["prompts"] == r["prompts"]]
        if r["temperature"] == 0 and plain:
            r["greedy_identical_to_plain"] = sum(
                a == b for a, b in zip(r["outputs"], plain[0]["outputs"]))


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| engine | config | T | prompts | tok/s | tau | speedup vs own plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['config']} | {r['temperature']} | {r['prompts']} | "
                     f"{r['tok_s']:.2f} | {r['tau']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def goal_table(rows: list[dict[str, Any]]) -> str:
    """Best draft-model speedup of each engine per setting, and their ratio (goal: >= 1.25)."""
    lines = ["| T | prompts | specdec best draft config | speedup | transformers best assisted "
             "| speedup | ratio |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["temperature"], r["prompts"]) for r in rows})
    def best(engine: str, prefix: str, temp: float, kind: str) -> dict[str, Any] | None:
        cand = [r for r in rows if r["engine"] == engine and r["temperature"] == temp
                and r["prompts"] == kind and r["config"].startswith(prefix)]
        return max(cand, key=lambda r: r["speedup"]) if cand else None

    for temp, kind in keys:
        o = best("specdec", "draft", temp, kind)
        h = best("transformers", "assisted", temp, kind)
        if o and h:
            lines.append(f"| {temp} | {kind} | {o['config']} | {o['speedup']:.2f}x | "
                         f"{h['config']} | {h['speedup']:.2f}x | "
                         f"{o['speedup'] / h['speedup']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--sharegpt", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--ours-draft", default="4:1,7:1", help="k:branches for the draft model")
    ap.add_argument("--ours-ngram", default="4:2", help="k:branches for n-gram lookup")
    ap.add_argument("--hf-k", default="4", help="matched num_assistant_tokens values")
    ap.add_argument("--hf-lookup", default="4", help="prompt_lookup_num_tokens values")
    ap.add_argument("--sampled-lookup", action="store_true",
                    help="also run n-gram / prompt lookup at temperature > 0")
    ap.add_argument("--engines", default="specdec,transformers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-reps", type=int, default=5)
    ap.add_argument("--kv-mib", type=int, default=1024, help="specdec's CPU KV cache budget")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    args.ours_draft = parse_pairs(args.ours_draft)
    args.ours_ngram = parse_pairs(args.ours_ngram)
    args.hf_k = [int(k) for k in args.hf_k.split(",") if k]
    args.hf_lookup = [int(k) for k in args.hf_lookup.split(",") if k]
    args.engines = [e for e in args.engines.split(",") if e]
    return args


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from specdec.hub import resolve_model_path

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.target))
    sets = {k: prompt_sets.load(k, tok, n)
            for k, n in (("humaneval", args.humaneval), ("sharegpt", args.sharegpt)) if n > 0}
    day = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out) if args.out else RESULTS / f"cpu_spec_{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("target", "draft", "dtype", "max_tokens",
                                              "temperatures", "ours_draft", "ours_ngram",
                                              "hf_k", "hf_lookup", "threads")}
    settings["prompt_tokens"] = {k: [len(p) for p in v] for k, v in sets.items()}
    result: dict[str, Any] = {"machine": machine_info(args.threads), "settings": settings,
                              "rows": []}
    log("prompts", settings["prompt_tokens"])
    if "specdec" in args.engines:
        rows, result["verify_cost"] = run_ours(args, sets)
        result["rows"] += rows
        out.write_text(json.dumps(result, indent=2))
    if "transformers" in args.engines:
        result["rows"] += run_hf(args, sets)
    add_speedups(result["rows"])
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["table"], result["goal_table"] = table(result["rows"]), goal_table(result["rows"])
    out.write_text(json.dumps(result, indent=2))
    print(result["table"])
    print()
    print(result["goal_table"])
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
