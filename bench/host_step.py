"""Host time of an engine step: what the GPU waits for when a step is not overlapped.

A tiny random Llama on the CPU (2 layers, hidden 64, vocabulary 512) makes the forward pass
cheap, and the runner's forward is timed and subtracted: what is left is the engine's own work
per step (scheduling, drafting, trees and masks, input packing, verification, KV commits,
detokenizing, outputs). Batch 16, 64-token prompts (--prompt-tokens: up to 900, the tiny
model's 1024 positions less the new tokens), 96 new tokens, greedy; plain decoding and the
replay drafter (k = 7, tau about 3) as a chain and as a tree of 2 branches.

With overlap on, a step's outputs are built (detokenized) after the next step's pass is
launched, so on a GPU that part runs beside the device: "serial" is the host work left between
reading a step back and launching the next (the CPU runs everything in turn, so the total is
the same here). Plain decodes then chain (specdec/chaining.py); speculative steps are drafted on
the host, as on a GPU with a host drafter.

    PYTHONPATH=. python3 bench/host_step.py [--out FILE] [--prompt-tokens N]
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
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="prompt length (the GPU benchmarks' contexts are 1k tokens)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from drafters import replay
    from specdec import LLM, SamplingParams

    path = make_model_dir(Path(tempfile.mkdtemp()), "tiny", TINY)
    # One engine per overlap setting (RuntimeConfig.overlap), each with its own timers. Chained
    # speculative steps stay off (spec_overlap): on the CPU their device-side staging runs on
    # the host, work a GPU's host does not do; plain decodes chain as on the GPU.
    llms = {on: LLM(model=str(path), speculative={"method": "none"}, max_num_seqs=16,
                    load_format="dummy", overlap=on, spec_overlap=False)
            for on in (False, True)}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 512, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(16)]
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for p, o in zip(prompts, llms[False].generate(prompts, greedy)):
        replay.record(p, o.token_ids)

    forward, deferred = [0.0], [0.0]

    def timer(fn, acc):
        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[0] += time.perf_counter() - t
            return out
        return timed

    for llm in llms.values():
        llm.engine.runner.execute = timer(llm.engine.runner.execute, forward)
        llm.engine.outputs.build = timer(llm.engine.outputs.build, deferred)

    def host_ms(spec: dict, overlap: bool) -> tuple[float, float]:
        """(host ms per step, of which serial with the device)."""
        eng = llms[overlap].engine
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, speculative=spec)
        for i, p in enumerate(prompts):
            eng.add_request(f"{time.monotonic()}-{i}", p, params)
        steps, forward[0], deferred[0] = 0, 0.0, 0.0
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        host = (time.perf_counter() - t0 - forward[0]) / steps * 1e3
        return host, host - (deferred[0] / steps * 1e3 if overlap else 0.0)

    rate = replay.rate_for_tau(3, 7)
    specs = {"plain": {"method": "none"},
             "chain": {"method": "replay", "num_speculative_tokens": 7, "corrupt_rate": rate},
             "tree": {"method": "replay", "num_speculative_tokens": 7, "branches": 2,
                      "corrupt_rate": rate}}
    res: dict = {"python": platform.python_version(), "torch": torch.__version__,
                 "machine": platform.machine(), "batch": 16,
                 "prompt_tokens": args.prompt_tokens, "host_ms_per_step": {}}
    for name, spec in specs.items():
        for overlap in (False, True):
            host_ms(spec, overlap)  # warm-up
            runs = [host_ms(spec, overlap) for _ in range(args.repeats)]
            key = f"{name}_overlap" if overlap else name
            res["host_ms_per_step"][key] = {
                "median": statistics.median(r[0] for r in runs),
                "serial_median": statistics.median(r[1] for r in runs),
                "fastest": min(r[0] for r in runs), "serial_fastest": min(r[1] for r in runs),
                "runs": runs}
            print(f"{key}: {statistics.median(r[0] for r in runs):.3f} ms of host work per "
                  f"step, {statistics.median(r[1] for r in runs):.3f} ms serial (median of "
                  f"{args.repeats}; fastest {min(r[0] for r in runs):.3f} / "
                  f"{min(r[1] for r in runs):.3f})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
