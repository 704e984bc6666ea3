"""How far the quantized weights move each preset from its dequantized float32 model.

For every preset: the quantized model (`quantization="auto"`, the default) writes a greedy
continuation of `--tokens` tokens for each of `--prompts` HumanEval prompts; then both models
score prompt + continuation in one pass each (teacher forcing). Reported per preset:

- `greedy_agreement`: the tokens before the float32 model's greedy choice first differs from the
  quantized model's, as a fraction of all generated tokens. Up to that point the two greedy
  outputs are the same sequence, so this is exactly the common prefix of the two greedy outputs;
  `identical_outputs` counts prompts where they never differ.
- `top1_agreement`: positions where the two models' argmax agree, along the quantized output.
- `mean_kl`: mean KL(P_float32 || P_quantized) of the next-token distributions, in nats.

    python bench/cpu_quant_quality.py --out bench/results/cpu_quant_quality_$(date +%Y%m%d).json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _logits(runner, ids: list[int]) -> torch.Tensor:  # [len(ids), V] float32
    from specdec.step_inputs import Segment

    bs = runner.block_size
    blocks = -(-len(ids) // bs)
    seg = Segment(tokens=ids, positions=list(range(len(ids))), slots=list(range(len(ids))),
                  context_len=0, block_table=list(range(blocks)),
                  logits_rows=tuple(range(len(ids))))
    return runner.execute([seg]).logits.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--presets", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()

    from prompts import humaneval_texts

    from specdec import LLM, SamplingParams

    texts = humaneval_texts(a.prompts)
    results = {}
    for preset in a.presets.split(","):
        t0 = time.monotonic()
        quant = LLM(model=preset, speculative={"method": "none"})
        tok = quant.tokenizer
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
        outs = [o.token_ids for o in quant.generate(prompts, sp)]
        q_logits = [_logits(quant.engine.runner, pr + out) for pr, out in zip(prompts, outs)]
        kinds = sorted({p.kind for m in quant.engine.runner.model.modules()
                        if hasattr(m, "parts") for p in m.parts})
        del quant
        ref = LLM(model=preset, speculative={"method": "none"}, quantization="none")
        top1 = n = prefix = identical = 0
        kl_sum = 0.0
        for pr, out, ql in zip(prompts, outs, q_logits):
            fl = _logits(ref.engine.runner, pr + out)
            rows = slice(len(pr) - 1, len(pr) - 1 + len(out))  # the rows that predict `out`
            fq, qq = fl[rows], ql[rows]
            f_arg = fq.argmax(-1)
            agree = (f_arg == torch.tensor(out)).tolist()
            first = agree.index(False) if False in agree else len(agree)
            prefix += first
            identical += first == len(agree)
            top1 += int((f_arg == qq.argmax(-1)).sum())
            lf, lq = torch.log_softmax(fq, -1), torch.log_softmax(qq, -1)
            kl_sum += float((lf.exp() * (lf - lq)).sum())
            n += len(out)
        del ref
        results[preset] = {
            "greedy_agreement": prefix / n, "identical_outputs": identical,
            "top1_agreement": top1 / n, "mean_kl": kl_sum / n, "positions": n,
            "quantized_kinds": kinds, "seconds": time.monotonic() - t0,
        }
        print(preset, json.dumps(results[preset]), flush=True)
    Path(a.out).write_text(json.dumps({
        "what": "bench/cpu_quant_quality.py: quantized (auto) against dequantized float32",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "torch": torch.__version__, "settings": vars(a), "results": results}, indent=1))


if __name__ == "__main__":
    main()
