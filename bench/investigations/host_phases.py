"""Where the engine's host time goes per decode step at a large batch, plain against drafted:
a tiny random Llama on the CPU (bench/host_step.py's), B sequences of 64-token prompts, 64 new
tokens, greedy, the replay drafter proposing a chain k deep with the ShareGPT draft-model profile
of bench/results/goodput_cpu_20261202.json (host proposals, as the GPU sweep's replayed cells at
batch 64-128). Each engine phase is wrapped and timed; the fastest of three runs per mode, its
decode steps only (prefills done first). Drafted steps are not overlapped (`spec_overlap` off:
on the CPU their device staging would run on the host), plain steps chain as on a GPU.

    PYTHONPATH=. python3 bench/investigations/host_phases.py [--batch 128] [--k 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_host_profile import wrap_timed
from gpu_setup import make_model_dir
from host_step import TINY

SURVIVAL = "0.6835,0.5029,0.3460,0.2613"
# (object path on the engine, method, name); names indented are parts of `commit`
PHASES = [("committer", "commit", "commit"), ("drafting", "record", "  record"),
          ("outputs", "stop_check", "  stop_check"), ("blocks", "commit", "  blocks.commit"),
          ("drafting", "accepted", "  drafting.accepted"), ("drafting", "depths", "depths"),
          ("scheduler", "schedule", "schedule"), ("drafting", "propose", "propose"),
          ("runner", "execute", "execute"), ("outputs", "build", "outputs"),
          ("chainer", "qualifies", "qualifies")]


def wrap_phases(eng, engine_module, phases, acc: dict[str, float]) -> None:
    """Every (engine attribute, method, name) of `phases`, and the engine's segments and
    verification, timed into acc."""
    for attr, name, key in phases:
        wrap_timed(getattr(eng, attr), name, key, acc)
    wrap_timed(engine_module, "plan_segments", "segments", acc)
    wrap_timed(engine_module, "verify_step", "verify_step", acc)


def decode_steps(eng, acc: dict[str, float]) -> tuple[int, float]:
    """Run the engine's requests to their end: their prefills first, then, with acc cleared,
    their decode steps; (steps, seconds) of those."""
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    acc.clear()
    steps, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return steps, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import specdec.engine as engine_module
    from drafters import replay
    from specdec import LLM, SamplingParams

    path = make_model_dir(Path(tempfile.mkdtemp()), "tiny", TINY)
    llm = LLM(model=str(path), speculative={"method": "none"}, max_num_seqs=args.batch,
              load_format="dummy", overlap=True, spec_overlap=False,
              max_num_batched_tokens=16384)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 512, (64,), generator=g).tolist() for _ in range(args.batch)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, greedy)):
        replay.record(p, o.token_ids)
    eng = llm.engine
    acc: dict[str, float] = {}
    wrap_phases(eng, engine_module, PHASES, acc)
    res: dict = {"batch": args.batch, "k": args.k, "survival": SURVIVAL, "modes": {}}
    specs = {"plain": {"method": "none"},
             "drafted": {"method": "replay", "num_speculative_tokens": args.k,
                         "survival": SURVIVAL}}
    for mode, spec in specs.items():
        best = None
        for _ in range(3):
            params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                    speculative=spec)
            for i, p in enumerate(prompts):
                eng.add_request(f"{mode}-{time.monotonic()}-{i}", p, params)
            steps, total = decode_steps(eng, acc)
            if best is None or total < best[0]:
                best = (total, steps, dict(acc))
        total, steps, parts = best
        row = {"steps": steps, "ms_per_step": total / steps * 1e3,
               "host_ms_per_step": (total - parts["execute"]) / steps * 1e3,
               "phases_ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in
                                      sorted(parts.items(), key=lambda x: -x[1])}}
        res["modes"][mode] = row
        print(f"{mode}, batch {args.batch}: {steps} steps, {row['ms_per_step']:.3f} ms a step, "
              f"{row['host_ms_per_step']:.3f} ms of it host work (all but execute)")
        for k, v in row["phases_ms_per_step"].items():
            print(f"   {k:22s} {v:.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
