"""`specdec train-drafter`: train an EAGLE head for a target.

    specdec train-drafter --target smollm2-135m --data sharegpt --out heads/smollm2 \
        [--eagle3] [--num-samples 256] [--self-distill 128 [--distill-samples 2]] \
        [--epochs 4] [--max-feature-gb 4] [--quantize int8]

1. Texts: ShareGPT first turns (through the chat template; with `--responses` followed by the
   recorded reply), HumanEval prompts, `pystdlib` (documented functions of this interpreter's
   standard library, `def` line through docstring after the module's imports, shuffled; past
   the first `--skip`), or a JSONL file with "text" (raw) or "prompt" (chat) per line.
   `--also DIR` adds the features an earlier run captured in DIR. The first `--skip`
   ShareGPT records are left out: they are the held-out prompts of bench/ and of the final
   tau report.
2. Optionally each prompt is continued by the target's own greedy output (`--self-distill N`
   tokens): the head then learns the text the target will actually verify. With
   `--distill-samples S` each prompt also gets S continuations of N tokens sampled at
   `--distill-temperature` (default 0.7), each request seeded from `--seed` so a rerun draws
   the same ones; a draw repeating one already kept for its prompt is redrawn. Sampled text
   is what the head meets when requests sample. The sequences are kept in
   OUT/features/sequences.json, so a rerun does not generate them again.
3. The target runs over the data in batches and stores what the engine would hand the
   drafter: the final normed hidden state (EAGLE-1/2) or the residual streams of the three
   captured layers (EAGLE-3), plus the target's greedy next token at every position. They go
   to OUT/features/shard_00000.pt and on (`--shard-size` sequences each, fp16 features), each
   written whole or not at all: a rerun recomputes only missing or stale shards. The store is
   bounded by `--max-feature-gb` (estimated as tokens x (2 x feature width + 8) bytes): once
   the next sequence would pass it, no more are collected (it says so) and training uses what
   fits. An old-style OUT/features.pt is still read instead if present.
4. Training unrolls the head `--ttt-steps` times, feeding back its own predicted features as
   drafting does (a step-s row attends committed keys and its own earlier draft keys only).
   Loss: smooth-L1 to the target's next feature (EAGLE-1/2 only) plus cross-entropy to the
   target's greedy token, computed over the tokens seen as labels (a cheap stand-in for the full
   vocabulary on CPU). A new EAGLE-3 head starts with the target's final norm and LM-head
   rows. AdamW, linear warm-up then cosine decay, bf16 autocast on CUDA; a checkpoint after
   every epoch makes a rerun resume (train_state.pt, also holding each epoch's mean loss).
5. `--quantize int8` stores the head's Linear weights as int8 with float16 scales per output
   row (or per `--quant-group-size` columns): half the float16 size, for shipping
   (drafters/eagle_quant.py; `drafters.eagle_head.quantize_head(DIR)` does it to an
   existing head).
6. tau is measured through the engine on held-out ShareGPT prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from drafters.eagle_head import (
    EagleHead,
    draft_to_target,
    head_config,
    load_head,
    save_head,
    set_draft_vocab,
    target_to_draft,
)
from specdec.drafter_data import (
    collect_shards,
    encode,
    feature_dim,
    load_shards,
    self_distill,
    texts,
)


def _batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    t = max(r["tokens"].numel() for r in rows)
    b = len(rows)
    fdim = rows[0]["feats"].shape[1]
    out = {"tokens": torch.zeros(b, t, dtype=torch.long),
           "next": torch.zeros(b, t, dtype=torch.long), "feats": torch.zeros(b, t, fdim),
           "mask": torch.zeros(b, t, dtype=torch.bool)}
    for i, r in enumerate(rows):
        n = r["tokens"].numel()
        out["tokens"][i, :n] = r["tokens"]
        out["next"][i, :n] = r["next"]
        out["feats"][i, :n] = r["feats"].float()
        out["mask"][i, :n] = True
    return out


def unrolled_loss(head: EagleHead, embed: torch.nn.Module, vocab_rows: torch.Tensor,
                  label_map: torch.Tensor, bt: dict[str, torch.Tensor], steps: int, ce_weight: float
                  ) -> tuple[torch.Tensor, list[float]]:
    """Loss of `steps` drafting steps from every position; top-1 accuracy per step.

    vocab_rows [Vs, H]: the target LM-head rows of the label vocabulary (EAGLE-1/2);
    label_map [V]: target token -> index into those rows (or the draft vocabulary), -1 if
    absent."""
    x, nxt, f, m = bt["tokens"], bt["next"], bt["feats"], bt["mask"]  # [B, T], .., [B, T, F]
    tp = x.shape[1] - steps  # rows 0 .. tp-1 draft `steps` tokens each
    if tp < 1:
        return torch.zeros((), requires_grad=True), [0.0] * steps
    dev = x.device
    fused = head.fuse(f)  # [B, T, H]
    eye = torch.eye(tp, dtype=torch.bool, device=dev)
    mask = torch.ones(tp, tp, dtype=torch.bool, device=dev).tril()
    h = fused[:, :tp]
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    total = torch.zeros((), device=dev)
    acc: list[float] = []
    for s in range(1, steps + 1):
        pos = torch.arange(s - 1, s - 1 + tp, device=dev)
        emb = embed(x[:, s:s + tp])  # [B, tp, H]
        h, k, v = head.step(h, emb, pos, past, mask)
        past = (k, v) if past is None else (torch.cat([past[0], k], 1),
                                            torch.cat([past[1], v], 1))
        mask = torch.cat([mask, eye], 1)  # later steps see their own earlier draft keys
        valid = m[:, s:s + tp]  # [B, tp]: the label position exists
        labels = label_map[nxt[:, s:s + tp]]  # [B, tp]
        keep = valid & (labels >= 0)
        if head.eagle3:
            logits = head.lm_head(head.norm(h[keep]))  # [n, draft_vocab]
        else:
            logits = h[keep] @ vocab_rows.T  # [n, Vs]
        weight = 0.8 ** (s - 1)
        ce = F.cross_entropy(logits.float(), labels[keep])
        loss = ce_weight * ce
        if not head.eagle3:
            loss = loss + F.smooth_l1_loss(h[valid].float(), f[:, s:s + tp][valid].float())
        total = total + weight * loss
        acc.append(float((logits.argmax(-1) == labels[keep]).float().mean()) if keep.any()
                   else 0.0)
    return total, acc


def train(head: EagleHead, embed: torch.nn.Module, lm_w: torch.Tensor,
          data: list[dict[str, torch.Tensor]], args: argparse.Namespace, out: Path) -> None:
    dev = args.device
    vocab = lm_w.shape[0]
    if head.eagle3:
        label_map = target_to_draft(head, torch.arange(vocab, device=head.d2t.device)).cpu()
        vocab_rows = lm_w[:0]
    else:
        seen = torch.unique(torch.cat([r["next"] for r in data]))  # [Vs]
        label_map = torch.full((vocab,), -1, dtype=torch.long)
        label_map[seen] = torch.arange(seen.numel())
        vocab_rows = lm_w[seen].to(dev)
    label_map = label_map.to(dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(data) / args.batch_size)
    total = per_epoch * args.epochs
    warm = max(1, int(args.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warm, 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, i - warm) / max(1, total - warm))))))
    state_file = out / "train_state.pt"
    start_epoch = 0
    losses: list[float] = []  # mean loss of each epoch
    if state_file.is_file():
        st = torch.load(state_file, map_location="cpu", weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch = st["epoch"]
        losses = list(st.get("losses", []))
        print(f"resuming after epoch {start_epoch}")
    amp = dev.startswith("cuda")
    from tqdm import tqdm

    g = torch.Generator().manual_seed(args.seed)
    for epoch in range(start_epoch, args.epochs):
        perm = torch.randperm(len(data), generator=g).tolist()
        head.train()
        bar = tqdm(range(per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}")
        total_loss = 0.0
        for i in bar:
            rows = [data[j] for j in perm[i * args.batch_size:(i + 1) * args.batch_size]]
            bt = {k: v.to(dev) for k, v in _batch(rows).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss, acc = unrolled_loss(head, embed, vocab_rows, label_map, bt,
                                          args.ttt_steps, args.ce_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            total_loss += float(loss.detach())
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}",
                            acc="/".join(f"{a:.2f}" for a in acc))
        losses.append(total_loss / per_epoch)
        print(f"epoch {epoch + 1}: mean loss {losses[-1]:.4f}")
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch + 1, "losses": losses},
                   state_file.with_suffix(".tmp"))
        state_file.with_suffix(".tmp").replace(state_file)
        save_head(head, out, torch.float16 if args.half else torch.float32, args.quantize,
                  args.quant_group_size)


@torch.no_grad()
def init_from_target(head: EagleHead, target: torch.nn.Module) -> None:
    """A new EAGLE-3 head starts from the target's final norm and the target's LM-head rows of
    its draft vocabulary: the head learns to predict a state the target's own output layer
    reads, instead of learning that layer too from a few thousand sequences."""
    rows = draft_to_target(head, torch.arange(head.d2t.numel(), device=head.d2t.device))
    head.lm_head.weight.copy_(target.lm_head.weight[rows.to(target.lm_head.weight.device)])
    head.norm.weight.copy_(target.model.norm.weight)


def sequences(args: argparse.Namespace, model_path: str, fdir: Path) -> list[list[int]]:
    """The token sequences to train on, kept in fdir/sequences.json: self-distillation is
    not redone on a rerun, and a rerun with other data settings is refused."""
    from transformers import AutoTokenizer

    names = ("target", "data", "num_samples", "skip", "max_len", "responses", "self_distill",
             "distill_samples") + (("distill_temperature", "seed") if args.distill_samples else ())
    key = {k: getattr(args, k) for k in names}  # what the sequences depend on
    f = fdir / "sequences.json"
    if f.is_file():
        saved = json.loads(f.read_text())
        if saved["key"] != key:
            raise SystemExit(f"{fdir} holds data made with {saved['key']}, not {key}: "
                             "delete it or choose another --out")
        return saved["seqs"]
    t0 = time.time()
    items = texts(args.data, args.num_samples, args.skip, args.responses)
    seqs = encode(AutoTokenizer.from_pretrained(model_path), items, args.max_len)
    if args.self_distill:
        seqs = self_distill(args.target, seqs, args.self_distill, args.distill_samples,
                            args.distill_temperature, args.seed)
        print(f"self-distilled {len(seqs)} sequences in {time.time() - t0:.0f}s")
    fdir.mkdir(parents=True, exist_ok=True)
    f.with_suffix(".tmp").write_text(json.dumps({"key": key, "seqs": seqs}))
    f.with_suffix(".tmp").replace(f)
    return seqs


def training_data(args: argparse.Namespace, model_path: str, target_hf: dict[str, Any],
                  out: Path) -> list[dict[str, torch.Tensor]]:
    """Rows of tokens [T], feats [T, F], next [T]: an old-style out/features.pt if there is
    one, else the feature shards of out/features/ (captured now where missing)."""
    if (out / "features.pt").is_file():
        return torch.load(out / "features.pt", weights_only=False)
    fdir = out / "features"
    seqs = sequences(args, model_path, fdir)
    probe = EagleHead(head_config(target_hf, args.eagle3, args.draft_vocab))
    capture = probe.capture_layers(int(target_hf["num_hidden_layers"]))
    paths = collect_shards(model_path, seqs, capture,
                           feature_dim(int(target_hf["hidden_size"]), capture), fdir,
                           args.batch_size, args.device, args.shard_size,
                           args.max_feature_gb * 1e9)
    return load_shards(paths)


def measure_tau(target: str, head_dir: Path, n: int, max_tokens: int) -> dict[str, Any]:
    """tau (tokens per target pass) of the head on held-out ShareGPT prompts, greedy."""
    from transformers import AutoTokenizer

    from specdec import LLM, SamplingParams
    from specdec.config import ModelConfig, resolve_model_config

    path = resolve_model_config(ModelConfig(model=target)).path
    prompts = encode(AutoTokenizer.from_pretrained(path), texts("sharegpt", n, 0), 1024)
    res: dict[str, Any] = {"prompts": len(prompts), "max_tokens": max_tokens}
    for name, opts in (("chain4", {"num_speculative_tokens": 4, "top_k": 1}),
                       ("tree", {"num_speculative_tokens": 5, "top_k": 4, "max_nodes": 16})):
        llm = LLM(model=target, speculative={"method": "eagle", "eagle_head": str(head_dir),
                                             **opts}, max_num_seqs=16)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        res[name] = round(llm.engine.spec_totals["eagle"].tau, 3)
        print(f"tau {name}: {res[name]}")
    return res


def main(argv: list[str] | None = None) -> int:
    from specdec.cli_options import HelpFormatter

    ap = argparse.ArgumentParser(prog="specdec train-drafter", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", default="sharegpt", help="sharegpt, humaneval or a .jsonl file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eagle3", action="store_true")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary")
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--skip", type=int, default=200, help="held-out ShareGPT records")
    ap.add_argument("--max-len", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--responses", action="store_true",
                    help="ShareGPT: train on the first user turn and its reply")
    ap.add_argument("--self-distill", type=int, default=0, metavar="N",
                    help="continue each prompt with N greedy target tokens")
    ap.add_argument("--distill-samples", type=int, default=0, metavar="S",
                    help="and with S sampled continuations of N tokens each (seeded)")
    ap.add_argument("--distill-temperature", type=float, default=0.7, metavar="T")
    ap.add_argument("--max-feature-gb", type=float, default=4.0, metavar="G",
                    help="bound on the feature shards on disk; sequences past it are left out")
    ap.add_argument("--shard-size", type=int, default=64, help="sequences per feature shard")
    ap.add_argument("--quantize", choices=["int8"], default=None,
                    help="store the head's Linear weights as int8 with float16 scales")
    ap.add_argument("--quant-group-size", type=int, default=0,
                    help="columns per int8 scale (0: one scale per output row)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=float, default=0.05, help="fraction of the steps")
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--init", default=None, help="start from this head's weights")
    ap.add_argument("--also", action="append", default=[], metavar="DIR",
                    help="train on the feature shards of an earlier run's --out DIR too "
                    "(same target and head type; repeatable)")
    ap.add_argument("--half", action="store_true", help="store the head in float16")
    ap.add_argument("--eval-prompts", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.distill_samples and not args.self_distill:
        ap.error("--distill-samples needs --self-distill N (the continuation length)")
    if args.distill_samples < 0 or args.distill_temperature <= 0 or args.shard_size < 1:
        ap.error("--distill-samples must be >= 0, --distill-temperature > 0, --shard-size >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from specdec.config import ModelConfig, resolve_model_config

    mc = resolve_model_config(ModelConfig(model=args.target))
    target_hf = json.loads((Path(mc.path) / "config.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    data = training_data(args, str(mc.path), target_hf, out)
    for other in args.also:  # an earlier run's captured features, trained on as well
        rows = load_shards(sorted((Path(other) / "features").glob("shard_*.pt")))
        if not rows or (data and rows[0]["feats"].shape[1] != data[0]["feats"].shape[1]):
            raise SystemExit(f"--also {other}: no feature shards, or features of another "
                             "width (another target or head type)")
        data += rows
    if not data:
        raise SystemExit("no training sequences (is --max-feature-gb too small for one?)")
    print(f"{len(data)} sequences, {sum(r['tokens'].numel() for r in data)} tokens "
          f"({time.time() - t0:.0f}s)")
    from specdec.models.loader import build_model

    target = build_model(target_hf, str(mc.path), torch.float32, torch.device(args.device))
    for p in target.parameters():
        p.requires_grad_(False)
    head = EagleHead(head_config(target_hf, args.eagle3, args.draft_vocab)).to(args.device)
    if args.init:
        head = load_head(args.init, int(target_hf["hidden_size"]), device=args.device)
    elif head.eagle3:
        counts = torch.bincount(torch.cat([r["next"] for r in data]),
                                minlength=int(target_hf["vocab_size"]))
        # The target's most frequent greedy tokens: what the head's labels are.
        set_draft_vocab(head, counts.topk(min(args.draft_vocab, counts.numel())).indices)
        init_from_target(head, target)
    train(head, target.model.embed_tokens, target.lm_head.weight.detach(), data, args, out)
    print(f"head saved to {out} ({time.time() - t0:.0f}s)")
    if args.eval_prompts:
        res = measure_tau(args.target, out, args.eval_prompts, args.eval_tokens)
        (out / "eval.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
