"""Convert a GGUF file into an HF-style directory (config, float32 safetensors, tokenizer).

The weights are dequantized to float32 so the directory holds exactly the values llama.cpp
would compute with; no requantization error is added on top of the GGUF's own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

# Tokens that end a turn in the chat templates of the model families we ship; a model that
# stops only on its GGUF eos would run past the end of a chat reply for some of them.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def _eos_ids(config: object, tokenizer: object) -> list[int]:
    ids: list[int] = []
    eos = getattr(config, "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in _END_TOKENS if t in vocab]
    return sorted(set(ids))


def _load_weights(gguf_path: Path, config: object) -> torch.nn.Module:
    """Build the model on the meta device and assign the dequantized GGUF tensors to it.

    We call transformers' GGUF tensor reader directly rather than
    `AutoModelForCausalLM.from_pretrained(gguf_file=...)`: that path requires `accelerate`, and its
    newer packed-weight loader marks the model non-serializable. The reader applies the same
    name map and the same inverse of llama.cpp's q/k row permutation (checked in the tests).
    Building on meta avoids holding a second float32 copy of every weight.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    del tensors
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF {gguf_path.name} does not match {type(model).__name__}: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    if tied and model.get_output_embeddings().weight.is_meta:
        model.tie_weights()
    return model


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write `out_dir` from `gguf_path`; built in a temp dir beside it and renamed into place.

    An interrupted conversion therefore leaves only a `.tmp-*` dir that is never mistaken for a
    finished one (and is removed on any Python-level error).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    src_dir, name = str(gguf_path.parent), gguf_path.name
    stages = tqdm(total=4, desc=f"convert {name}", disable=not progress, unit="stage")
    try:
        stages.set_postfix_str("config + tokenizer")
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        stages.update()

        stages.set_postfix_str("dequantize weights")
        model = _load_weights(gguf_path, config)
        stages.update()

        stages.set_postfix_str("save safetensors")
        model.save_pretrained(tmp)
        del model
        tokenizer.save_pretrained(tmp)
        stages.update()

        stages.set_postfix_str("generation config")
        gen = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=_eos_ids(config, tokenizer),
            pad_token_id=getattr(config, "pad_token_id", None),
        )
        gen.save_pretrained(tmp)
        (tmp / "specdec_source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "size": gguf_path.stat().st_size}, indent=2)
        )
        stages.update()

        # mkdtemp and the safetensors writer make owner-only files; the cache is shared.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():  # another process finished first; its result is equivalent
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        stages.close()
    return out_dir
