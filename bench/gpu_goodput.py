"""The goodput controller's sweep on one GPU: batch 1-128, fixed k = 2, 4, 8 against the
controller and speculation off, with acceptance replayed from the per-position profiles that
bench/goodput_cpu.py measured on the CPU (n-gram and the draft model, HumanEval and ShareGPT).

The target has the Llama-3.1-8B shape with random weights (bench/gpu_setup.py), made
greedy-stable so that a recorded plain output stays the target's output; the replay drafter
proposes that output, corrupted per draft depth so that its survival follows the profile
(drafters/replay.py `survival`), each position's fate drawn alike in every cell (the same
prompt, position and try: cells that draft alike get the same acceptance, so they compare on the
same luck). The drafter itself costs nothing here: the sweep measures what
verification costs at each batch size and whether the controller's depths follow it. Decode
throughput is tokens after every request's first token over that time; every speculative run's
output must equal the plain run's. Every cell, speculation off included, runs twice with the
profile's others in turn, the faster kept. `--planned-every-step` adds the controller with
its held choice asked again at every host-built step (as before Drafting._hold), for the A/B.

    PYTHONPATH=. python3 bench/gpu_goodput.py --profiles bench/results/goodput_cpu_DATE.json \\
        --out DIR [--batches 1,4,16,32,64,128] [--budget-s 540]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from gpu_setup import NOTE, SHAPES, bench_runtime, log, make_model_dir
from gpu_speculative import make_greedy_stable, run_requests

PROMPT_TOKENS = 256


def build(path: Path, max_batch: int, max_tokens: int):
    from specdec.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from specdec.engine import LLMEngine

    mc = ModelConfig(model=str(path), path=str(path), dtype="bfloat16", device="cuda",
                     load_format="dummy", max_model_len=4096)
    blocks = max_batch * ((PROMPT_TOKENS + max_tokens + 16) // 16 + 2) + 64
    cfg = EngineConfig(model=mc, cache=CacheConfig(num_blocks=blocks, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=max_batch,
                                                 max_num_batched_tokens=16384),
                       speculative=SpeculativeConfig(), runtime=bench_runtime())
    return LLMEngine(cfg, attention_backend="auto")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", required=True, help="bench/goodput_cpu.py's JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b-shape", choices=list(SHAPES))
    ap.add_argument("--batches", default="1,4,16,32,64,128")
    ap.add_argument("--k", default="2,4,8")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--fresh-costs", action="store_true",
                    help="each controller run starts from the calibration alone, as a server "
                         "just started does (else it also has every earlier run's steps)")
    ap.add_argument("--drafters", default="", help="profiles of these drafters only "
                    "(comma-separated; default: every one)")
    ap.add_argument("--planned-every-step", action="store_true",
                    help="also run the controller with every step's choice planned on the "
                         "host (Drafting._hold off: the held choice asked again each "
                         "step), as the cell `controller_planned`")
    ap.add_argument("--trace-batch", type=int, default=0,
                    help="at batches up to this, one JSON line per controller choice in "
                         "OUT/trace.jsonl: the depths chosen, the first sequence's survival, "
                         "the step and draft costs planned with, whether the choice is held")
    a = ap.parse_args()
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = json.loads(Path(a.profiles).read_text())["profiles"]
    batches = [int(b) for b in a.batches.split(",")]
    engine = build(make_model_dir(Path(tempfile.mkdtemp()), a.shape), max(batches), a.max_tokens)
    make_greedy_stable(engine.runner.model)
    if a.trace_batch:
        _trace_choices(engine, out / "trace.jsonl", a.trace_batch, a.k_max)
    t = time.monotonic()
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_all(max(batches), 16)
    curve = engine.calibrate_costs()
    import triton

    res = {"note": NOTE, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "shape": a.shape, "args": vars(a),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "setup_s": round(time.monotonic() - t, 1),
           "pass_curve_ms": {r: round(s * 1e3, 3) for r, s in curve.items()},
           "profiles": profiles, "rows": [], "mismatches": [], "complete": False}

    def save() -> None:
        (out / "gpu_goodput.json").write_text(json.dumps(res, indent=1))

    from drafters import replay

    g = torch.Generator().manual_seed(1)
    vocab = engine.runner.vocab_size
    for batch in batches:
        prompts = [torch.randint(100, vocab, (PROMPT_TOKENS,), generator=g).tolist()
                   for _ in range(batch)]
        run_requests(engine, prompts, {"method": "none"}, 8, f"warm{batch}")
        chained = engine.chainer.chained_steps
        plain = run_requests(engine, prompts, {"method": "none"}, a.max_tokens, f"off{batch}")
        off_chained = engine.chainer.chained_steps - chained
        replay.clear_recorded()
        for p, o in zip(prompts, plain.outputs):
            replay.record(p, o)
        for ds, per in profiles.items():
            for drafter, prof in per.items():
                if a.drafters and drafter not in a.drafters.split(","):
                    continue
                if time.monotonic() - t_start > a.budget_s:
                    log("budget spent: stopping")
                    save()
                    return
                surv = ",".join(f"{max(x, 1e-4):.4f}" for x in prof["survival"])
                row = {"batch": batch, "dataset": ds, "drafter": drafter, "survival": surv,
                       "tok_s": {"off": round(plain.rate, 1)}, "tau": {},
                       "off_chained_steps": off_chained}
                cells = {f"k={k}": {"num_speculative_tokens": int(k), "adaptive": False}
                         for k in a.k.split(",")}
                cells["controller"] = {"num_speculative_tokens": a.k_max, "adaptive": True}
                if a.planned_every_step:
                    cells["controller_planned"] = cells["controller"]
                cells["off"] = {}
                # Each cell twice, the faster kept: the first run of a shape may capture a
                # graph or tune a kernel inside its timed window. Speculation off too, among
                # them (and its first run above): a GPU's clocks move by a few percent over a
                # batch's rows, and off timed once at their start read up to 5% above a
                # controller that kept it off in all but its probes.
                for name, extra in [(n, e) for _ in range(2) for n, e in cells.items()]:
                    spec = ({"method": "replay", "survival": surv, **extra} if name != "off"
                            else {"method": "none"})
                    ctl = name.startswith("controller")
                    if ctl and a.fresh_costs:
                        engine.drafting.controller.costs.forget_steps()
                        engine.drafting.controller.forget_evidence()
                    before = _depths(engine)
                    chained = engine.chainer.chained_steps
                    if name == "controller_planned":
                        engine.drafting._hold = lambda decoding: False
                    run = run_requests(engine, prompts, spec, a.max_tokens,
                                       f"{ds}{drafter}{batch}{name}{time.monotonic_ns()}")
                    engine.drafting.__dict__.pop("_hold", None)
                    if ctl:  # what it chose, and the costs it planned with
                        row.setdefault(f"{name}_runs", []).append(
                            _controller_detail(engine, before, batch, a.k_max, run.rate)
                            | {"chained_steps": engine.chainer.chained_steps - chained})
                    elif name != "off":  # the real steps' times by rows after each fixed k
                        passes = engine.drafting.controller.costs.passes.best
                        row.setdefault("real_pass_ms", {})[name] = {
                            str(r): round(v * 1e3, 3) for r, v in sorted(passes.items())}
                    if run.outputs != plain.outputs:
                        res["mismatches"].append(f"b={batch} {ds} {drafter} {name}")
                    if run.rate > row["tok_s"].get(name, 0.0):
                        row["tok_s"][name] = round(run.rate, 1)
                        row["tau"][name] = round(run.tau, 3)
                off = row["tok_s"]["off"]
                row["vs_off"] = {n: round(v / off, 3) for n, v in row["tok_s"].items()}
                best = max((n for n in row["tok_s"] if n.startswith("k=")),
                           key=lambda n: row["tok_s"][n])
                row["best_fixed"] = best
                row["controller_vs_best_fixed"] = round(row["tok_s"]["controller"]
                                                        / row["tok_s"][best], 3)
                res["rows"].append(row)
                log(json.dumps(row))
                save()
    res["controller_stats"] = engine.stats()["speculation_control"]
    res["complete"] = True
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    save()


def _trace_choices(engine, path: Path, max_batch: int, k_max: int) -> None:
    """Wrap the controller's `choose`: what it planned with and chose, at batches up to
    `max_batch` (the cells where it fell short of the best fixed k)."""
    ctl = engine.drafting.controller
    choose, f = ctl.choose, path.open("a", buffering=1)

    def traced(base_rows, plain, cands, batch=0, base_q=1):
        out = choose(base_rows, plain, cands, batch, base_q)
        n = batch or plain + len(cands)
        if cands and n <= max_batch:
            c, costs = cands[0].alternatives[0], ctl.costs
            f.write(json.dumps({
                "step": ctl._step, "batch": n, "method": c.method,
                "ks": sorted(ch.k for ch in out.values()),
                "surv": [round(x, 3) for x in c.survival[:k_max]],
                "step_ms": [round(costs.step_time(n, q, len(cands) if q > 1 else 0) * 1e3, 3)
                            for q in range(1, k_max + 2)],
                "draft_ms": [round(costs.draft.time(c.method, len(cands), d) * 1e3, 3)
                             for d in range(1, k_max + 1)],
                "held": ctl.holding, "period": ctl.probe_period}) + "\n")
        return out

    ctl.choose = traced


def _depths(engine) -> dict[str, int]:
    st = engine.drafting.controller.stats.get("replay")
    return dict(st.depths) if st is not None else {}


def _controller_detail(engine, before: dict, batch: int, k_max: int, rate: float) -> dict:
    """The depths the controller chose in one run (a histogram over sequence-steps) and its
    cost model after it: the pass by rows, the drafted step's extra by drafting sequences."""
    after = _depths(engine)
    costs = engine.drafting.controller.costs
    rows = sorted({batch, 2 * batch, batch * (k_max + 1) // 2, batch * (k_max + 1)})
    return {"tok_s": round(rate, 1),
            "depths": {str(d): after.get(d, 0) - before.get(d, 0) for d in sorted(after)
                       if after.get(d, 0) - before.get(d, 0)},
            "pass_ms": {str(r): round(costs.pass_time(r) * 1e3, 3) for r in rows},
            "spec_ms": {str(n): round(costs.spec_time(n) * 1e3, 3)
                        for n in sorted({1, max(1, batch // 2), batch})}}


if __name__ == "__main__":
    main()

