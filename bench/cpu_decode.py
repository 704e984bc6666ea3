"""Plain decoding (speculation off) on the CPU: specdec against transformers' `generate`, side by
side in one process, on the same HumanEval prompts, dtype, thread count and output length.

    python bench/cpu_decode.py --models smollm2-135m,qwen2.5-coder-0.5b \\
        --dtypes float32,bfloat16 --batches 1,16 --max-tokens 64 --repeats 3 --threads 2

Every output is forced to --max-tokens (specdec: ignore_eos; transformers: min_new_tokens).
transformers runs a batch left-padded with an attention mask. Decode tokens/s counts the tokens
after the first one of every sequence over the time from the last first token to the end, so
prefill is excluded on both sides; end-to-end tokens/s is reported beside it. Runs alternate
between the two engines, after a warm-up, and the median over repeats is reported. Writes
bench/results/cpu_decode_<date>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import prompts as prompt_sets

RESULTS = Path(__file__).resolve().parent / "results"
T0 = time.monotonic()


def log(*a: Any) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s]", *a, flush=True)


def machine_info(threads: int) -> dict[str, Any]:
    import transformers

    cpu = platform.processor()
    family_model: list[str] = []  # two "AMD EPYC" differ: family 25 model 17 is Zen 4
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() in ("cpu family", "model") and len(family_model) < 2:
                family_model.append(value.strip())
            elif not line.strip():
                break
    except OSError:
        pass
    if family_model:
        cpu += f" (family {' model '.join(family_model)})"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "avx512": " avx512f" in flags, "avx2": " avx2" in flags, "threads": threads,
            "loadavg_start": os.getloadavg()}


def matmul_probe(reps: int = 20) -> dict[str, float]:
    """Milliseconds of one [M, 2048] x [2048, 2048] linear, float32 against bfloat16: says
    whether this CPU has fast bfloat16 matmul."""
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(2048, 2048, dtype=dtype)
        for m in (1, 8, 16):
            x = torch.randn(m, 2048, dtype=dtype)
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                torch.nn.functional.linear(x, w)
                ts.append(time.perf_counter() - t)
            out[f"{str(dtype).split('.')[-1]}_M{m}_ms"] = round(statistics.median(ts) * 1e3, 3)
    return out


# ---- one timed run per engine ------------------------------------------------------------

def run_ours(llm: Any, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from specdec import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, ignore_eos=True)
    start = time.monotonic()
    outs = llm.generate(batch, sp)
    end = time.monotonic()
    assert all(len(o.token_ids) == max_tokens for o in outs), "an output ended early"
    first = max(o.first_token_time for o in outs)
    return {"e2e_s": end - start, "decode_s": end - first, "tokens": [o.token_ids for o in outs]}


class _FirstTokenClock:
    """A stopping criterion that never stops: it notes when the first new token exists."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **_: Any) -> torch.Tensor:
        if self.first is None:
            self.first = time.monotonic()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros(len(batch), width, dtype=torch.long)  # [B, S]
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generation_config(tokenizer: Any, max_tokens: int, **kw: Any) -> Any:
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            pad_token_id=pad, eos_token_id=eos, **kw)


@torch.inference_mode()
def run_hf(model: Any, tokenizer: Any, batch: list[list[int]], max_tokens: int
           ) -> dict[str, Any]:
    from transformers import StoppingCriteriaList

    gc_ = hf_generation_config(tokenizer, max_tokens)
    ids, mask = left_pad(batch, gc_.pad_token_id)
    clock = _FirstTokenClock()
    start = time.monotonic()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc_,
                         stopping_criteria=StoppingCriteriaList([clock]))
    end = time.monotonic()
    new = out[:, ids.shape[1]:]  # [B, max_tokens]
    assert new.shape[1] == max_tokens, "transformers stopped early"
    return {"e2e_s": end - start, "decode_s": end - (clock.first or start),
            "tokens": new.tolist()}


def summarise(runs: list[dict[str, Any]], bsz: int, max_tokens: int) -> dict[str, Any]:
    e2e = statistics.median(r["e2e_s"] for r in runs)
    dec = statistics.median(r["decode_s"] for r in runs)
    return {"e2e_s": round(e2e, 4), "decode_s": round(dec, 4),
            "e2e_tok_s": round(bsz * max_tokens / e2e, 3),
            "decode_tok_s": round(bsz * (max_tokens - 1) / dec, 3),
            "decode_tok_s_runs": [round(bsz * (max_tokens - 1) / r["decode_s"], 3) for r in runs]}


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- one model and dtype -----------------------------------------------------------------

def bench_model(name: str, dtype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec import LLM, SamplingParams
    from specdec.hub import resolve_model_path

    path = resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path)
    pool = prompt_sets.load(args.prompts, tok, max(args.batches))
    log(f"{name} {dtype}: loading")
    llm = LLM(model=name, dtype=dtype, device="cpu", speculative={"method": "none"},
              cpu_kv_bytes=args.kv_mib << 20)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    rows = []
    for bsz in args.batches:
        batch = pool[:bsz]
        # Warm-up: both engines, the full batch, a short output.
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        run_hf(hf, tok, batch, 4)
        ours, theirs = [], []
        for rep in range(args.repeats):
            ours.append(run_ours(llm, batch, args.max_tokens))
            theirs.append(run_hf(hf, tok, batch, args.max_tokens))
            log(f"{name} {dtype} batch {bsz} repeat {rep}: ours "
                f"{bsz * (args.max_tokens - 1) / ours[-1]['decode_s']:.2f} tok/s, transformers "
                f"{bsz * (args.max_tokens - 1) / theirs[-1]['decode_s']:.2f} tok/s")
        so, st = summarise(ours, bsz, args.max_tokens), summarise(theirs, bsz, args.max_tokens)
        match = [same_prefix(a, b) for a, b in zip(ours[0]["tokens"], theirs[0]["tokens"])]
        rows.append({
            "model": name, "dtype": dtype, "batch": bsz, "max_tokens": args.max_tokens,
            "prompt_tokens": [len(p) for p in batch], "specdec": so, "transformers": st,
            "decode_ratio": round(so["decode_tok_s"] / st["decode_tok_s"], 3),
            "e2e_ratio": round(so["e2e_tok_s"] / st["e2e_tok_s"], 3),
            "greedy_same_prefix_mean": round(statistics.mean(match), 2),
            "greedy_identical": sum(m == args.max_tokens for m in match)})
        log(f"{name} {dtype} batch {bsz}: ratio {rows[-1]['decode_ratio']}")
    del llm, hf
    gc.collect()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | dtype | batch | specdec decode tok/s | transformers decode tok/s | ratio "
             "| e2e ratio | greedy outputs identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['batch']} | "
                     f"{r['specdec']['decode_tok_s']:.2f} | "
                     f"{r['transformers']['decode_tok_s']:.2f} | {r['decode_ratio']:.2f}x | "
                     f"{r['e2e_ratio']:.2f}x | {r['greedy_identical']}/{r['batch']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="humaneval", choices=["humaneval", "sharegpt"])
    ap.add_argument("--kv-mib", type=int, default=1024, help="specdec's CPU KV cache budget")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info(args.threads)
    info["matmul_probe_ms"] = matmul_probe()
    log("machine", json.dumps(info))
    day = datetime.date.today().strftime("%Y%m%d")
    out = Path(args.out) if args.out else RESULTS / f"cpu_decode_{day}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": info, "settings": {
        k: getattr(args, k) for k in ("models", "dtypes", "batches", "max_tokens", "repeats",
                                      "threads", "prompts")}, "rows": []}
    for name in args.models:
        for dtype in args.dtypes:
            result["rows"] += bench_model(name, dtype, args)
            info["loadavg_end"] = os.getloadavg()
            result["table"] = table(result["rows"])
            out.write_text(json.dumps(result, indent=2))  # a run cut short keeps its rows
    print(result["table"])
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
