"""One EAGLE head step on the CPU, the head's Linears dequantized to float32 against kept int8
on the quantized kernels: a randomly initialised EAGLE-3 head of a target's shape (by default
qwen2.5-coder-1.5b's, draft vocabulary 4096, as `specdec train-drafter --eagle3` builds it),
stored int8 and loaded both ways. A step is one drafted position: fuse the captured features,
the layer over 256 committed head positions, the draft LM head (fastest of 30 passes). A
catch-up is the head over a sequence's first positions at once, as its first proposal runs it
(fastest of 3).

    PYTHONPATH=. python3 bench/investigations/eagle_head_step.py [--target PRESET] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from drafters.eagle_head import EagleHead, head_config, load_head, save_head, set_draft_vocab
from specdec.config import ModelConfig, resolve_model_config


def step_ms(head: EagleHead, hidden: int, past: int) -> float:
    feats, emb = torch.randn(1, 3 * hidden), torch.randn(1, hidden)
    a = head.midlayer.self_attn
    kv = (torch.randn(past, a.kv_heads, a.head_dim), torch.randn(past, a.kv_heads, a.head_dim))
    mask = torch.ones(1, past + 1, dtype=torch.bool)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(30):
            t = time.perf_counter()
            h, _, _ = head.step(head.fuse(feats), emb, torch.tensor([past]), kv, mask)
            head.logits(h, torch.nn.Identity())
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def catch_up_ms(head: EagleHead, hidden: int, rows: int) -> float:
    """The head over `rows` positions at once, as its first proposal for a sequence runs it
    (fusing their features included); fastest of 3."""
    feats, emb = torch.randn(rows, 3 * hidden), torch.randn(rows, hidden)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t = time.perf_counter()
            head.step(head.fuse(feats), emb, torch.arange(rows), None, mask)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--catch-up", type=int, nargs="*", default=[256, 1536],
                    help="positions of a first proposal's catch-up to time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_config(ModelConfig(model=args.target)).path
    hf = json.loads((Path(path) / "config.json").read_text())
    hidden = int(hf["hidden_size"])
    with tempfile.TemporaryDirectory() as d:
        head = EagleHead(head_config(hf, True, args.draft_vocab))
        set_draft_vocab(head, torch.arange(args.draft_vocab))
        save_head(head, d, quantize="int8")
        size = (Path(d) / "model.safetensors").stat().st_size
        res = {"target": args.target, "draft_vocab": args.draft_vocab, "threads": args.threads,
               "head_mb": round(size / 1e6, 1)}
        for name, int8 in (("float32", False), ("int8_kernels", True)):
            head = load_head(d, hidden, int8_kernels=int8)
            res[f"{name}_step_ms"] = round(step_ms(head, hidden, 256), 2)
            for rows in args.catch_up:
                res[f"{name}_catch_up_{rows}_ms"] = round(catch_up_ms(head, hidden, rows), 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
