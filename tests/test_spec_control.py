"""The draft-length controller, with made-up costs (no model, no timing)."""

from __future__ import annotations

from specdec import LLM, SamplingParams
from specdec.outputs import SpecMetrics
from specdec.spec_control import Candidate, SpeculationController, expected_tokens


def metrics(accepted: int, rejected: int) -> SpecMetrics:
    m = SpecMetrics(method="ngram")
    m.accepted_tokens, m.rejected_steps = accepted, rejected
    return m


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert expected_tokens(1.0, 4) == 5.0


def test_measures_plain_first_then_explores_then_keeps_what_pays():
    c = SpeculationController()
    cand = [Candidate("a", "ngram", 4, metrics(90, 10), 1)]
    assert c.choose(1, 0, cand) == {"a": 0}  # nothing measured: plain first
    c.record_pass(1, 1.0)
    assert c.choose(1, 0, cand) == {"a": 4}  # a larger pass is assumed no dearer: try it
    c.record_pass(5, 1.1)  # cheap verification (a GPU): keep speculating
    assert c.choose(1, 0, cand) == {"a": 4}


def test_backs_off_when_verification_is_expensive():
    c = SpeculationController()
    c.record_pass(1, 1.0)
    for rows in (2, 4, 8):
        c.record_pass(rows, 0.5 + 0.5 * rows)  # cost grows with every row (a small CPU)
    cand = [Candidate("a", "ngram", 4, metrics(40, 60), 1)]
    assert c.choose(1, 0, cand) == {"a": 0}
    # A request whose drafts are nearly always accepted still gains from drafting.
    good = [Candidate("b", "ngram", 4, metrics(990, 1), 1)]
    assert c.choose(1, 0, good)["b"] > 0


def test_draft_cost_counts():
    c = SpeculationController()
    for rows in (1, 2, 4, 8):
        c.record_pass(rows, 1.0)
    c.record_draft("draft_model", 4, 40.0)  # a drafter slower than the target
    cand = [Candidate("a", "draft_model", 4, metrics(80, 20), 1)]
    assert c.choose(1, 0, cand) == {"a": 0}


def test_adaptive_engine_keeps_greedy_output(tiny_llama):
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9]]
    ref = LLM(model=str(tiny_llama), speculative={"method": "none"}).generate(prompts, p)
    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram"},
              adaptive_speculation=True)
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.drafting.controller.pass_time  # costs were measured
