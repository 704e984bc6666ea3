"""Host time of an engine step: what the GPU waits for when a step is not overlapped.

A tiny random Llama on the CPU (2 layers, hidden 64, vocabulary 512) makes the forward pass
cheap, and the runner's forward is timed and subtracted: what is left is the engine's own work
per step (scheduling, drafting, trees and masks, input packing, verification, KV commits,
detokenizing, outputs). Batch 16, 64-token prompts, 96 new tokens, greedy; plain decoding and
the replay drafter (k = 7, tau about 3) as a chain and as a tree of 2 branches.

    PYTHONPATH=. python3 bench/host_step.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_setup import make_model_dir

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 0, "torch_dtype": "float32"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from drafters import replay
    from specdec import LLM, SamplingParams

    path = make_model_dir(Path(tempfile.mkdtemp()), "tiny", TINY)
    llm = LLM(model=str(path), speculative={"method": "none"}, max_num_seqs=16,
              load_format="dummy")
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 512, (64,), generator=g).tolist() for _ in range(16)]
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for p, o in zip(prompts, llm.generate(prompts, greedy)):
        replay.record(p, o.token_ids)
    forward = [0.0]
    execute = eng.runner.execute

    def timed(*a, **k):
        t = time.perf_counter()
        out = execute(*a, **k)
        forward[0] += time.perf_counter() - t
        return out

    eng.runner.execute = timed

    def host_ms(spec: dict) -> float:
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, speculative=spec)
        for i, p in enumerate(prompts):
            eng.add_request(f"{time.monotonic()}-{i}", p, params)
        steps, forward[0] = 0, 0.0
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        return (time.perf_counter() - t0 - forward[0]) / steps * 1e3

    rate = replay.rate_for_tau(3, 7)
    specs = {"plain": {"method": "none"},
             "chain": {"method": "replay", "num_speculative_tokens": 7, "corrupt_rate": rate},
             "tree": {"method": "replay", "num_speculative_tokens": 7, "branches": 2,
                      "corrupt_rate": rate}}
    res: dict = {"python": platform.python_version(), "torch": torch.__version__,
                 "machine": platform.machine(), "batch": 16, "host_ms_per_step": {}}
    for name, spec in specs.items():
        host_ms(spec)  # warm-up
        runs = [host_ms(spec) for _ in range(args.repeats)]
        res["host_ms_per_step"][name] = {"median": statistics.median(runs), "runs": runs}
        print(f"{name}: {statistics.median(runs):.2f} ms of host work per step "
              f"(median of {args.repeats})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
