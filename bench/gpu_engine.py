"""The engine on one GPU: decode against the bandwidth roofline, the verification cost curve,
speculative speedup at controlled acceptance (the replay drafter), and transformers' `generate`.

Models have the exact shapes of Llama-3.1-8B and Qwen2.5-7B in bfloat16 with RANDOM weights
(`load_format="dummy"`): speed depends on shapes, not values. Run: PYTHONPATH=. python3
bench/gpu_engine.py --out DIR (bench/gpu_run.sh). Every section writes DIR/gpu_engine.json as it
finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from gpu_setup import (
    CTX,
    NOTE,
    SHAPES,
    T0,
    build_engine,
    check_triton,
    copy_bandwidth,
    kv_bytes,
    log,
    make_model_dir,
    step_segments,
    time_steps,
    weight_bytes,
)
from gpu_speculative import run_requests, speculative


def cost_curve(engine, res: dict, bw: float, batches, sizes) -> None:
    wb = weight_bytes(engine.runner.model)
    curve = {}
    for batch in batches:
        base = time_steps(engine, step_segments(engine, batch, 1, CTX))
        row = {"decode_step_ms": base * 1e3,
               "decode_roofline_ms": (wb + batch * kv_bytes(engine.config.model, CTX)) / bw * 1e3}
        for n in sizes:
            t = time_steps(engine, step_segments(engine, batch, n, CTX))
            row[str(n)] = t / base
            log(f"cost batch {batch} rows {n}: {row[str(n)]:.3f} ({base * 1e3:.3f} ms decode)")
        curve[str(batch)] = row
        log(f"cost curve batch {batch}: " + " ".join(
            f"{k}:{v:.3f}" for k, v in row.items()))
    res["verify_cost_ratio"] = curve
    res["verify_cost_ratio_note"] = ("time of one pass over n query rows per sequence (the root "
                                      "and n - 1 tree nodes) / time of a 1-row decode step")


def graph_vs_eager(engine, res: dict) -> None:
    segs = step_segments(engine, 2, 4, CTX)
    g = engine.runner.execute(segs).logits
    graphs, engine.runner.graphs = engine.runner.graphs, None
    e = engine.runner.execute(segs).logits
    t_eager = time_steps(engine, step_segments(engine, 1, 1, CTX))
    engine.runner.graphs = graphs
    res["graph_vs_eager_logits_max_abs_diff"] = float((g - e).abs().max())
    res["eager_decode_step_ms_b1"] = t_eager * 1e3


def hf_peer(path: Path, res: dict, new_tokens: int = 32) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(path))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, cfg.vocab_size, (1, CTX), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)
    t1, tn = gen(1), gen(new_tokens + 1)
    res["transformers_generate_b1_tokens_per_s"] = new_tokens / (tn - t1)
    log(f"transformers generate b1: {res['transformers_generate_b1_tokens_per_s']:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=380.0)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="new tokens per request in the decode runs")
    ap.add_argument("--spec-max-tokens", type=int, default=512,
                    help="new tokens per request in the speculative runs and their plain "
                         "baseline: the longer the run, the smaller its tail, the steps after "
                         "the first request of a batch finishes (128 until 2026-12-01)")
    ap.add_argument("--quick", action="store_true",
                    help="batch 1 only: the cost curve and plain decode, no speculative runs "
                         "and no transformers peer")
    ap.add_argument("--sizes", default=None,
                    help="the cost curve's row counts, comma-separated ('' for the 1-row step "
                         "alone: each size captures and tunes a graph, slow on a cold cache)")
    ap.add_argument("--cost-batches", default=None,
                    help="the cost curve's batch sizes, comma-separated (default 1,8,16,32 for "
                         "the first model, 1 for the others and with --quick)")
    ap.add_argument("--spec-batches", default=None,
                    help="the speculative runs' batch sizes (default 1,16 for the first model)")
    ap.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    report = {
        "note": NOTE, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "context_tokens": CTX, "models": {},
    }

    def save() -> None:
        (out_dir / "gpu_engine.json").write_text(json.dumps(report, indent=1))

    bw = copy_bandwidth()
    report["copy_bandwidth_bytes_per_s"] = bw
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    backend = check_triton()
    report["attention_backend"] = backend
    save()
    tmp = Path(tempfile.mkdtemp())
    for mi, name in enumerate(args.models.split(",")):
        def left() -> float:
            return args.budget_s - (time.monotonic() - T0)

        if left() < 60:
            log(f"skipping {name}: out of time")
            break
        res: dict = {}
        report["models"][name] = res
        path = make_model_dir(tmp, name)
        engine = build_engine(path, backend, num_blocks=2600)
        log(f"{name}: built")
        m = engine.runner.model
        res["weight_bytes_per_step"] = weight_bytes(m)
        res["kv_bytes_per_seq_at_ctx"] = kv_bytes(engine.config.model, CTX)
        res["cuda_graphs"] = engine.runner.graphs is not None
        floor = (res["weight_bytes_per_step"] + res["kv_bytes_per_seq_at_ctx"]) / bw
        res["decode_b1_roofline_tokens_per_s"] = 1 / floor
        engine.runner.kv.normal_()  # attention over finite, non-zero KV
        sizes = (2, 4, 8, 16, 32, 64) if mi == 0 else (2, 4, 8, 16)
        if args.sizes is not None:
            sizes = tuple(int(x) for x in args.sizes.split(",") if x)
        batches = (1, 8, 16, 32) if mi == 0 and not args.quick else (1,)
        if args.cost_batches:
            batches = tuple(int(x) for x in args.cost_batches.split(","))
        cost_curve(engine, res, bw, batches, sizes)
        if "1" in res["verify_cost_ratio"]:  # (--cost-batches may leave batch 1 out)
            b1 = res["verify_cost_ratio"]["1"]["decode_step_ms"] / 1e3
            res["decode_b1_runner_step_fraction_of_roofline"] = floor / b1
        save()  # before the graph-vs-eager check's capture: a run cut there keeps the curve
        if engine.runner.graphs is not None and args.sizes != "":  # ("": 1-row graphs only)
            graph_vs_eager(engine, res)
        save()
        if left() > (30 if args.quick else 120):
            from drafters import replay

            prompt = torch.randint(100, engine.runner.vocab_size, (CTX,)).tolist()
            replay.clear_recorded()
            r = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens, "dec").rate
            res["decode_b1_engine_tokens_per_s"] = r
            res["decode_b1_engine_fraction_of_roofline"] = r * floor
            log(f"{name}: engine decode b1 {r:.1f} tok/s = {r * floor:.0%} of roofline")
            # The same without chained decoding (specdec/chaining.py): each step read back
            # before the next is launched.
            runtime = engine.config.runtime
            engine.use_runtime(replace(runtime, overlap=False))
            r0 = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens,
                              "dec-sync").rate
            engine.use_runtime(runtime)
            res["decode_b1_engine_no_overlap_tokens_per_s"] = r0
            log(f"{name}: engine decode b1 without overlap {r0:.1f} tok/s = "
                f"{r0 * floor:.0%} of roofline")
            # Sampled (temperature 1, top-p 0.95, seeded), with and without overlap.
            for on in (True, False):
                engine.use_runtime(replace(runtime, overlap=on))
                rs = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens,
                                  f"dec-sampled-{on}", temperature=1.0).rate
                key = "sampled" if on else "sampled_no_overlap"
                res[f"decode_b1_engine_{key}_tokens_per_s"] = rs
                log(f"{name}: engine decode b1 {key} {rs:.1f} tok/s = {rs * floor:.0%}")
            engine.use_runtime(runtime)
            save()
            sb = (1, 16) if mi == 0 else (1,)
            if args.spec_batches:
                sb = tuple(int(x) for x in args.spec_batches.split(","))
            taus = (2, 3, 4, 5) if mi == 0 else (3,)
            if not args.quick:
                speculative(engine, res, sb, taus, k=7, tree_branches=2,
                            max_tokens=args.spec_max_tokens,
                            profile_dir=out_dir if mi == 0 else None)
            save()
        if engine.runner.graphs is not None:
            res["graph_tuning"] = {str(k): v for k, v in engine.runner.graphs.tuned.items()}
            res["graph_buckets_captured"] = sorted(map(list, engine.runner.graphs.graphs))
        del engine, m
        torch.cuda.empty_cache()
        if left() > 45 and not args.quick and not args.no_peer:
            try:
                hf_peer(path, res)
                torch.cuda.empty_cache()
            except Exception as e:
                res["transformers_generate_error"] = f"{type(e).__name__}: {e}"
                log(res["transformers_generate_error"])
        save()
    print_table(report)


def print_table(report: dict) -> None:
    print("\n== gpu_engine:", report["gpu"], "torch", report["torch"], "triton",
          report["triton"], "| backend", report.get("attention_backend"), "| RANDOM WEIGHTS")
    print(f"copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s")
    for name, r in report["models"].items():
        print(f"-- {name}")
        for k in ("decode_b1_roofline_tokens_per_s", "decode_b1_runner_step_fraction_of_roofline",
                  "decode_b1_engine_tokens_per_s", "decode_b1_engine_fraction_of_roofline",
                  "decode_b1_engine_no_overlap_tokens_per_s",
                  "decode_b1_engine_sampled_tokens_per_s",
                  "decode_b1_engine_sampled_no_overlap_tokens_per_s",
                  "eager_decode_step_ms_b1", "graph_vs_eager_logits_max_abs_diff",
                  "transformers_generate_b1_tokens_per_s"):
            if k in r:
                print(f"   {k}: {r[k]:.4g}")
        for b, row in r.get("verify_cost_ratio", {}).items():
            print(f"   cost b{b}: " + " ".join(f"{k}={v:.3f}" for k, v in row.items()))
        for b, row in r.get("speculative", {}).items():
            cells = [f"plain {row['plain_tokens_per_s']:.0f}/s"]
            for k, v in row.items():
                if isinstance(v, dict):
                    cells.append(f"{k}: tau {v['tau_measured']:.2f} x{v['speedup']:.2f}")
            print(f"   spec b{b}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
