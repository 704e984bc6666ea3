"""Speculation keeps the output distribution: end-to-end histograms against exact enumeration.

A tiny target with an 8-token vocabulary samples thousands of short continuations of one prompt
(one request each, seeded) with and without a drafter. The exact distribution of the first
three generated tokens is enumerated from the same checkpoint with transformers, through the
same sampling transforms, and the two are compared by a chi-square test at fixed seeds. Requests
generate five or six tokens so that the first decode step verifies a tree of up to three or four
nodes (the first token comes from the prefill): the first three tokens then depend on the
acceptance of the root's children and of their children."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_verifier import chisquare_p
from tiny_models import make_model

import specdec.verdict as verdict
from specdec import LLM, SamplingParams
from specdec.sampler import RowContext, process_logits
from verify_kernels.reference import VerifyResult, verify_tree

V = 8
PROMPT = [1, 2, 3, 4, 1, 3, 2, 4, 1, 2, 5, 3, 6, 1]
REQUESTS = 2000
ALPHA = 1e-3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Thousands of tiny per-sequence attention calls: threading only adds contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    target = make_model(tmp_path_factory.mktemp("dist_target"), "llama", vocab_size=V,
                        hidden=32, layers=2, seed=5, std=0.15)
    draft = make_model(tmp_path_factory.mktemp("dist_draft"), "llama", vocab_size=V,
                       hidden=32, layers=1, seed=6, std=0.15)
    return target, draft


@pytest.fixture(scope="module")
def llm(models) -> LLM:
    target, draft = models
    return LLM(model=str(target), speculative={"method": "draft_model", "draft_model": str(draft)},
               max_num_seqs=1024, max_num_batched_tokens=16384)


def exact_joint(model: Path, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V, V] probability of each first three generated tokens, by enumeration."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float64).eval()
    joint = torch.ones(())
    for n in range(3):
        prefixes = [list(p) for p in itertools.product(range(V), repeat=n)]
        ids = torch.tensor([prompt + p for p in prefixes])
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].float()  # [V ** n, V]
        probs = process_logits(logits, [params] * len(prefixes),
                               [RowContext(prompt, p) for p in prefixes]).double()
        joint = joint[..., None] * probs.view(*([V] * n), V)
    return joint


def sample(llm: LLM, spec: dict[str, Any], seed: int, max_tokens: int = 5, **kw: Any
           ) -> tuple[torch.Tensor, int, int]:
    """Counts [V ** 3] of the first three generated tokens, and how many draft tokens were
    verified and accepted (0 without speculation)."""
    params = [SamplingParams(seed=seed + i, max_tokens=max_tokens, ignore_eos=True,
                             speculative=spec, **kw) for i in range(REQUESTS)]
    outs = llm.generate([PROMPT] * REQUESTS, params)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    idx = torch.tensor([(o.token_ids[0] * V + o.token_ids[1]) * V + o.token_ids[2]
                        for o in outs])
    drafted = sum(o.spec.draft_tokens for o in outs if o.spec is not None)
    accepted = sum(o.spec.accepted_tokens for o in outs if o.spec is not None)
    return torch.bincount(idx, minlength=V ** 3), drafted, accepted


NGRAM_CHAIN = {"method": "ngram", "num_speculative_tokens": 3, "branches": 1}
NGRAM_TREE = {"method": "ngram", "num_speculative_tokens": 2, "branches": 2, "max_n": 1}
DRAFT_CHAIN = {"method": "draft_model", "num_speculative_tokens": 3}
DRAFT_TREE = {"method": "draft_model", "num_speculative_tokens": 2, "branches": 2}
FILTERS = {"temperature": 0.8, "top_k": 5, "top_p": 0.9}
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3}

# A draft-model tree of depth 2 with 2 branches has 4 nodes: six tokens leave room for it.
CASES = {
    "plain": ({"method": "none"}, {}),
    "ngram-chain": (NGRAM_CHAIN, {}),
    "ngram-tree": (NGRAM_TREE, {}),
    "draft-chain": (DRAFT_CHAIN, {}),
    "draft-tree": (DRAFT_TREE, {"max_tokens": 6}),
    "ngram-tree-filters": (NGRAM_TREE, FILTERS),
    "draft-chain-filters-penalties": (DRAFT_CHAIN, {**FILTERS, **PENALTIES}),
    "draft-tree-penalties": (DRAFT_TREE, {**PENALTIES, "max_tokens": 6}),
    # Chains that stop where the draft is unsure (at 0.3, of 8 tokens, about 60% of the draft
    # tokens are not drafted): the stop reads the draft alone, so the target's law holds.
    "draft-chain-p-min": ({**DRAFT_CHAIN, "p_min": 0.3}, FILTERS),
    # The goodput controller on: per-sequence depths, and for auto the drafter, per step.
    "adaptive-draft-chain": ({**DRAFT_CHAIN, "adaptive": True}, {}),
    "auto": ({"method": "auto", "num_speculative_tokens": 3}, FILTERS),
}


@pytest.mark.parametrize("case", list(CASES))
def test_continuations_follow_the_target(llm, models, case, monkeypatch):
    spec, kw = CASES[case]
    if spec.get("adaptive") or spec["method"] == "auto":
        # Costs as on a GPU at small batch (more rows and drafting nearly free): the
        # controller then drafts, so the test is not vacuous, and depths and drafters still
        # change from step to step (probes, acceptance). Every cost is set, the host work of
        # drafted steps too: the earlier cases' real steps would otherwise be read against
        # this pass time, as this machine's speed happens to make them.
        # And the acceptance evidence starts fresh: the earlier `p_min` case's stopped chains
        # (judged as rejections at the depth asked) would otherwise keep this one plain.
        llm.engine.drafting.controller.forget_evidence()
        costs = llm.engine.drafting.controller.costs
        monkeypatch.setattr(costs, "pass_time", lambda rows: 1.0 + 1e-4 * rows)
        monkeypatch.setattr(costs.draft, "time",
                            lambda method, batch, depth, reach=None: 1e-3 * depth)
        monkeypatch.setattr(costs, "spec_time", lambda speculating: 1e-6 * speculating)
        monkeypatch.setattr(costs.draft, "catch_up_time", lambda method, tokens: 1e-6 * tokens)
    counts, drafted, accepted = sample(llm, spec, seed=1000 * len(case), **kw)
    if spec["method"] != "none":  # drafts were proposed and accepted: the test is not vacuous
        assert drafted > REQUESTS // 2 and accepted > REQUESTS // 20
    if spec["method"] == "auto":  # ... by both drafters
        totals = llm.engine.spec_totals
        assert all(totals[m].draft_tokens > REQUESTS // 20 for m in ("ngram", "draft_model"))
    exact = exact_joint(models[0], PROMPT, SamplingParams(**kw))
    assert chisquare_p(counts, exact) > ALPHA


def eager_verify(probs, offsets, tree, greedy, node_u, bonus_u) -> VerifyResult:
    """Accepts drafted children too often: uniforms halved."""
    return verify_tree(probs, offsets, tree, greedy, node_u * 0.5, bonus_u)


def test_negative_control_biased_verifier_fails(llm, models, monkeypatch):
    monkeypatch.setattr(verdict, "verify_tree", eager_verify)
    counts, drafted, _ = sample(llm, NGRAM_CHAIN, seed=7)
    assert drafted > 0
    exact = exact_joint(models[0], PROMPT, SamplingParams())
    assert chisquare_p(counts, exact) < ALPHA


@pytest.mark.parametrize("spec", [DRAFT_CHAIN, DRAFT_TREE], ids=["chain", "tree"])
def test_reduced_draft_vocabulary_keeps_the_distribution(models, spec):
    """A draft model whose output layer covers part of the vocabulary (as the quantized CPU
    draft's does) never proposes the other tokens, and the output still follows the target
    sampled and equals plain decoding greedy."""
    target, draft = models
    llm = LLM(model=str(target), speculative={"method": "draft_model", "draft_model": str(draft)},
              max_num_seqs=1024, max_num_batched_tokens=16384)
    eng = llm.engine
    drafter = eng.drafting.drafter(eng.drafting.resolve(None))
    kept = [0, 1, 2, 3, 5]
    drafter.reduce_vocabulary(torch.tensor(kept))
    proposed: set[int] = set()
    propose = drafter.propose

    def spy(batch):
        tree = propose(batch)
        proposed.update(tree.tokens.tolist())
        return tree

    drafter.propose = spy
    kw = {"max_tokens": 6} if spec is DRAFT_TREE else {}
    counts, drafted, accepted = sample(llm, spec, seed=77, **kw)
    assert drafted > REQUESTS // 2 and accepted > REQUESTS // 20
    assert chisquare_p(counts, exact_joint(target, PROMPT, SamplingParams())) > ALPHA
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    plain = llm.generate([PROMPT], SamplingParams(**greedy, speculative={"method": "none"}))
    spec_out = llm.generate([PROMPT], SamplingParams(**greedy, speculative=spec))
    assert spec_out[0].token_ids == plain[0].token_ids
    assert proposed and proposed <= set(kept)
