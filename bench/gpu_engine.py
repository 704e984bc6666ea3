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
from pathlib import Path
from typing import NamedTuple

import torch
from gpu_host_profile import host_profile
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


class Run(NamedTuple):
    outputs: list[list[int]]  # token ids per prompt
    rate: float  # decode tokens/s once every request has its first token, to the end
    steady_rate: float  # the same while every request runs (until the first one finishes)
    tau: float  # tokens per verification step


def run_requests(engine, prompts, spec: dict, max_tokens: int, tag: str,
                 temperature: float = 0.0) -> Run:
    """Greedy requests, all added at once. `steady_rate` leaves out the tail in which requests
    that are done leave the batch (speculative requests finish at different steps): it is the
    rate of the batch size asked for, the one the ideal tau / cost describes."""
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                            max_tokens=max_tokens, ignore_eos=True, speculative=spec, seed=0)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    final, started, t0, base = {}, set(), None, 0
    steady = None
    emitted = steps = 0

    def produced() -> int:
        return (sum(len(s.output_token_ids) for s in engine.seqs.values())
                + sum(len(o.token_ids) for o in final.values()))

    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            started.add(out.request_id)
            if out.finished:
                final[out.request_id] = out
        if t0 is not None and steady is None and any(o.finished for o in outs):
            # Up to the outputs just returned, the finishing ones included.
            torch.cuda.synchronize()
            steady = (produced() - base) / (time.perf_counter() - t0)
        if t0 is None and len(started) == len(ids):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            base = produced()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    outs = [final[r].token_ids for r in ids]
    for r in ids:
        if final[r].spec is not None:
            emitted += final[r].spec.emitted_tokens
            steps += final[r].spec.steps
    rate = (sum(len(o) for o in outs) - base) / dt
    return Run(outs, rate, steady or rate, emitted / steps if steps else 1.0)


@torch.no_grad()
def make_greedy_stable(model) -> None:
    """Scale the embedding up and point the head at it: the model then predicts its input token
    by a wide margin, so bf16 rounding (which differs between pass shapes) never flips a greedy
    choice and a recorded script stays the target's output. Shapes and bytes are unchanged."""
    emb = model.model.embed_tokens.weight
    emb.mul_(1000.0)
    model.lm_head.weight.copy_(emb / 1000.0)


def speculative(engine, res: dict, batches, taus, k: int, tree_branches: int,
                max_tokens: int, profile_dir: Path | None = None) -> None:
    from drafters import replay

    make_greedy_stable(engine.runner.model)
    if engine.runner.graphs is not None:
        # Every bucket the runs below may meet, up front (as the server does at start): no
        # capture or tile tuning falls inside a timed window.
        t = time.monotonic()
        n = engine.runner.graphs.capture_all(max(batches), 16)
        res["graph_capture_all_s"] = time.monotonic() - t
        log(f"captured {n} more graphs in {res['graph_capture_all_s']:.1f} s")
    res["speculative_note"] = ("random weights with the embedding scaled x1000 and the head set "
                               "to it, so greedy outputs are stable under bf16 rounding and the "
                               "replayed script stays valid (tau follows the corrupt rate)")
    res["speculative_max_tokens"] = max_tokens

    g = torch.Generator().manual_seed(1)
    vocab = engine.runner.vocab_size
    default_spec_overlap = engine.spec_pipeline.enabled
    out = {}
    for batch in batches:
        low = min(100, vocab // 2)
        prompts = [torch.randint(low, vocab, (CTX,), generator=g).tolist() for _ in range(batch)]
        # Untimed: the first steps at a new batch size capture graphs and tune kernel tiles.
        run_requests(engine, prompts, {"method": "none"}, 8, f"warmplain{batch}")
        plain = run_requests(engine, prompts, {"method": "none"}, max_tokens, f"plain{batch}")
        plain_rate = plain.rate
        row = {"plain_tokens_per_s": plain_rate, "plain_steady_tokens_per_s": plain.steady_rate}
        log(f"batch {batch} plain: {plain_rate:.1f} tok/s (steady {plain.steady_rate:.1f})")
        costs = res.get("verify_cost_ratio", {}).get(str(batch), {})
        for shape, branches in (("chain", 1), ("tree", tree_branches)):
            base = {"method": "replay", "num_speculative_tokens": k, "branches": branches}
            # Record with every proposal rejected: the same tree shape as the replayed runs.
            replay.clear_recorded()
            rec = run_requests(engine, prompts, {**base, "corrupt_rate": 1.0}, max_tokens,
                               f"rec{batch}{shape}")
            for p, o in zip(prompts, rec.outputs):
                replay.record(p, o)
            row[f"{shape}_tau1_tokens_per_s"] = rec.rate
            rows = 1 + k * branches  # query rows per sequence: its bucket in the cost curve
            cost = costs.get(str(next(n for n in (2, 4, 8, 16, 32, 64) if n >= rows)))
            # Untimed: captures the graphs of the smaller batches that appear as requests
            # finish at different steps, and meets every kernel the accepted paths use (at
            # batch 1 the first KV compaction of a side branch fell inside the timed tau-2
            # tree run on 2026-12-01: 26% and 63% of ideal), so no capture, compile or
            # kernel load falls inside a timed run.
            run_requests(engine, prompts, {**base, "corrupt_rate": replay.rate_for_tau(
                taus[0], k)}, max_tokens, f"warm{batch}{shape}")
            # Chains run twice: drafted on the device with each step launched before the last
            # one's verdict is read back (specdec/spec_overlap.py, the engine's default with
            # overlap on), then drafted on the host between steps, as a host drafter (n-gram)
            # is ("_host" cells).
            modes = ((shape, True), (f"{shape}_host", False)) if branches == 1 else (
                (shape, True),)
            for (name, piped), tau in ((m, t) for m in modes for t in taus):
                rate = replay.rate_for_tau(tau, k)
                engine.spec_pipeline.enabled = piped and engine.pipeline.enabled
                chained = engine.spec_pipeline.chained_steps
                try:
                    run = run_requests(engine, prompts, {**base, "corrupt_rate": rate},
                                       max_tokens, f"s{batch}{name}{tau}")
                finally:
                    engine.spec_pipeline.enabled = default_spec_overlap
                cell = {"corrupt_rate": rate, "tau_measured": run.tau,
                        "overlapped_steps": engine.spec_pipeline.chained_steps - chained,
                        "output_equals_plain": run.outputs == rec.outputs,
                        "tokens_per_s": run.rate, "speedup": run.rate / plain_rate,
                        "steady_tokens_per_s": run.steady_rate,
                        "steady_speedup": run.steady_rate / plain.steady_rate}
                if cost:
                    cell.update(cost_ratio=cost, ideal=run.tau / cost,
                                of_ideal=cell["speedup"] * cost / run.tau,
                                steady_of_ideal=cell["steady_speedup"] * cost / run.tau)
                row[f"{name}_tau{tau}"] = cell
                log(f"batch {batch} {name} tau {tau}: measured tau {run.tau:.2f}, "
                    f"{run.rate:.1f} tok/s, speedup {cell['speedup']:.2f} "
                    f"(steady {cell['steady_speedup']:.2f})"
                    + (f", {cell['of_ideal']:.0%} / {cell['steady_of_ideal']:.0%} of ideal"
                       if cost else ""))
        out[str(batch)] = row
        res["speculative"] = out
        if batch > 1 and profile_dir is not None:
            base = {"method": "replay", "num_speculative_tokens": k, "branches": 1,
                    "corrupt_rate": replay.rate_for_tau(3, k)}
            # Of host-drafted steps (the overlapped ones leave the host no gap to profile).
            engine.spec_pipeline.enabled = False
            try:  # a diagnostic: its failure must not cost the run's measurements
                res[f"host_profile_b{batch}"] = host_profile(
                    engine, prompts, base, max_tokens, profile_dir / f"host_profile_b{batch}.txt")
            except Exception as e:
                log(f"host profile failed: {e!r}")
                res[f"host_profile_b{batch}"] = {"error": repr(e)}
            finally:
                engine.spec_pipeline.enabled = default_spec_overlap
    res["speculative"] = out


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
            # The same without overlapped decoding (specdec/overlap.py): each step read back
            # before the next is launched.
            engine.pipeline.enabled = False
            r0 = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens,
                              "dec-sync").rate
            engine.pipeline.enabled = True
            res["decode_b1_engine_no_overlap_tokens_per_s"] = r0
            log(f"{name}: engine decode b1 without overlap {r0:.1f} tok/s = "
                f"{r0 * floor:.0%} of roofline")
            # Sampled (temperature 1, top-p 0.95, seeded), with and without overlap.
            for on in (True, False):
                engine.pipeline.enabled = on
                rs = run_requests(engine, [prompt], {"method": "none"}, args.max_tokens,
                                  f"dec-sampled-{on}", temperature=1.0).rate
                key = "sampled" if on else "sampled_no_overlap"
                res[f"decode_b1_engine_{key}_tokens_per_s"] = rs
                log(f"{name}: engine decode b1 {key} {rs:.1f} tok/s = {rs * floor:.0%}")
            engine.pipeline.enabled = True
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
