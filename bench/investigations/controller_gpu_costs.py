"""The goodput controller's choices under a GPU's step costs, on this CPU: the engine runs a tiny
random model (greedy-stable, as bench/gpu_goodput.py makes its target) with the replay drafter
proposing the recorded plain output at a per-position survival profile, and every decode step's
time is replaced, before the controller sees it, by the pass of a GPU sweep's calibration at
its rows (`pass_curve_ms` of a bench/gpu_goodput.py JSON), times a uniform 0.97-1.10 jitter,
plus `--host-ms` for a drafted step planned on the host. The controller plans as on a GPU (one
depth for the batch, `uniform`). Each run starts from the calibration alone with no evidence,
as the sweep's `--fresh-costs` runs do; the runs differ in the replay's draws (request ids).
What it shows: how often the controller leaves a batch plain where drafting pays, without a
GPU. On 2026-12-07, batch 1, the HumanEval n-gram profile, 56 runs (8, 24 and 24): at e4db5f3,
9 sat plain for 5-233 of their ~150 steps (an H100 run had sat plain for 236); at 67d6356, whose
requests count their own verifications once (75662dc), none for more than 1.

    PYTHONPATH=. python3 bench/investigations/controller_gpu_costs.py --batch 1 \\
        --survival 0.2819,0.1446,0.1018,0.0746 --runs 8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2000, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 0, "torch_dtype": "float32"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--survival", default="0.2819,0.1446,0.1018,0.0746")
    ap.add_argument("--curve", default="bench/results/gpu_goodput_h100_20261207_share_a.json")
    ap.add_argument("--host-ms", type=float, default=0.7)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    a = ap.parse_args()
    torch.cuda.synchronize = lambda *_, **__: None  # gpu_speculative.run_requests times on CUDA
    from gpu_setup import make_model_dir
    from gpu_speculative import make_greedy_stable, run_requests

    from drafters import replay
    from specdec.cli_options import runtime_from_env
    from specdec.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )
    from specdec.cost_curve import Curve
    from specdec.engine import LLMEngine

    gpu = {int(r): ms / 1e3 for r, ms in json.loads(Path(a.curve).read_text())
           ["pass_curve_ms"].items()}
    path = make_model_dir(Path(tempfile.mkdtemp()), "tiny", TINY)
    mc = ModelConfig(model=str(path), path=str(path), dtype="float32", device="cpu",
                     load_format="dummy", max_model_len=4096)
    engine = LLMEngine(EngineConfig(
        model=mc, cache=CacheConfig(num_blocks=a.batch * 40 + 64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=a.batch, max_num_batched_tokens=16384),
        speculative=SpeculativeConfig(), runtime=runtime_from_env(tuning_cache=False)))
    make_greedy_stable(engine.runner.model)
    ctl = engine.drafting.controller
    ctl.uniform = True
    ctl.costs.calibration = Curve()
    for rows, sec in gpu.items():
        ctl.costs.calibration.record(rows, sec)
    rng = random.Random(0)
    record = ctl.record_pass

    def priced(rows, seconds, speculating=0, chained=False, batch=0, deepest=0):
        sec = gpu[min((r for r in gpu if r >= rows), default=max(gpu))]
        sec = sec * rng.uniform(0.97, 1.10) + (a.host_ms / 1e3 if speculating and not chained
                                               else 0.0)
        record(rows, sec, speculating, chained, batch, deepest)

    ctl.record_pass = priced
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, TINY["vocab_size"], (256,), generator=g).tolist()
               for _ in range(a.batch)]
    plain = run_requests(engine, prompts, {"method": "none"}, a.tokens, "off")
    for p, o in zip(prompts, plain.outputs):
        replay.record(p, o)
    for run in range(a.runs):
        ctl.costs.forget_steps()
        ctl.forget_evidence()
        out = run_requests(engine, prompts, {"method": "replay", "survival": a.survival,
                                             "num_speculative_tokens": a.k, "adaptive": True},
                           a.tokens, f"run{run}-")
        depths = dict(sorted(ctl.stats["replay"].depths.items()))
        assert out.outputs == plain.outputs
        print(json.dumps({"run": run, "tau": round(out.tau, 3),
                          "plain_steps": depths.get(0, 0) // a.batch,
                          "depths": {str(d): n for d, n in depths.items()}}), flush=True)


if __name__ == "__main__":
    main()
