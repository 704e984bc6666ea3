"""Turn a GGUF file into an HF-style directory that takes its weights from the GGUF itself.

The directory holds config.json, the tokenizer, generation_config.json and
specdec_source.json (`{"weights": "gguf", "gguf": PATH}`); no weight is written. The loader
(specdec/models/loader.py) reads the GGUF's tensors at start: kept quantized
(specdec/models/gguf_weights.py), or dequantized to float exactly as llama.cpp's own
dequantization does, so the cache never holds a float copy of a model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

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


def _has_output_layer(gguf_path: Path) -> bool:
    from gguf import GGUFReader

    return any(t.name == "output.weight" for t in GGUFReader(str(gguf_path)).tensors)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Write `out_dir` from `gguf_path`; built in a temp dir beside it and renamed into place.

    An interrupted conversion therefore leaves only a `.tmp-*` dir that is never mistaken for a
    finished one (and is removed on any Python-level error).
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    src_dir, name = str(gguf_path.parent), gguf_path.name
    stages = tqdm(total=3, desc=f"prepare {name}", disable=not progress, unit="stage")
    try:
        stages.set_postfix_str("config + tokenizer")
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        stages.update()

        # A file with its own output layer uses it, as llama.cpp does, even where the original
        # checkpoint tied it to the embedding (the GGUF may quantize the two differently).
        if getattr(config, "tie_word_embeddings", False) and _has_output_layer(gguf_path):
            config.tie_word_embeddings = False
        if not getattr(config, "architectures", None):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.save_pretrained(tmp)
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
            json.dumps({"weights": "gguf", "gguf": str(gguf_path),
                        "size": gguf_path.stat().st_size}, indent=2)
        )
        stages.update()

        # mkdtemp makes an owner-only directory; the cache is shared.
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
