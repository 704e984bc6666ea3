"""Tiny random checkpoints of every supported architecture, saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens t0..t{V-1}, with t0 as end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", unk_token="t1")
    fast.save_pretrained(str(path))


def make_model(path: Path, arch: str = "llama", vocab_size: int = 64, hidden: int = 64,
               layers: int = 2, heads: int = 4, kv_heads: int = 2, tied: bool = False,
               seed: int = 0, rope_scaling: dict | None = None, std: float = 0.3) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tied, eos_token_id=0, bos_token_id=None,
                  pad_token_id=None)
    if rope_scaling:
        common["rope_scaling"] = rope_scaling
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // heads, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    make_tokenizer(path, vocab_size)
    return path
