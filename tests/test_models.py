"""Our model modules give transformers' logits on tiny random checkpoints of each family."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model

from specdec.engine import LLMEngine
from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.step_inputs import Segment


def our_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every position, computed in prefill chunks of `chunk` tokens (so later
    chunks attend to a paged prefix written by earlier ones)."""
    seq = Sequence("x", ids, SamplingParams())
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        assert engine.blocks.reserve(seq, n)
        seg = Segment(ids[start:start + n], list(range(start, start + n)),
                      [engine.blocks.slot(seq, start + j) for j in range(n)], start,
                      list(seq.block_table), logits_rows=tuple(range(n)))
        out.append(engine.runner.execute([seg]).logits)
        engine.blocks.commit(seq, start + n)
    engine.blocks.free_seq(seq)
    return torch.cat(out)


CASES = [
    dict(arch="llama", heads=4, kv_heads=4, tied=False),
    dict(arch="llama", heads=4, kv_heads=2, tied=True),  # GQA, tied
    dict(arch="llama", heads=4, kv_heads=1, tied=False,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(arch="llama", heads=4, kv_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(arch="qwen2", heads=4, kv_heads=2, tied=True),
    dict(arch="qwen2", heads=4, kv_heads=2, tied=False,
         rope_scaling={"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 128}),
    dict(arch="qwen3", heads=4, kv_heads=2, tied=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    f"{k}={v}" if not isinstance(v, dict) else v.get("rope_type") for k, v in c.items()))
def test_logits_match_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    path = make_model(tmp_path / "m", vocab_size=96, hidden=64, **case)
    engine = LLMEngine.from_args(str(path), speculative={"method": "none"},
                                 block_size=4, num_blocks=64)
    ids = torch.randint(0, 96, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunk in (37, 10):
        ours = our_logits(engine, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    assert engine.blocks.num_used == 0 or engine.blocks.num_free == engine.blocks.num_blocks


def test_unknown_architecture_is_a_clear_error(tmp_path):
    import json

    path = make_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        LLMEngine.from_args(str(path), speculative={"method": "none"})


def test_dummy_load_needs_no_weights(tmp_path):
    path = make_model(tmp_path / "m")
    for f in path.glob("*.safetensors"):
        f.unlink()
    engine = LLMEngine.from_args(str(path), speculative={"method": "none"},
                                 load_format="dummy", num_blocks=16)
    assert engine.runner.model.lm_head.weight.abs().sum() > 0
