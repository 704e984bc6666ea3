"""The goodput controller, with made-up costs (no model, no timing), then on a tiny engine: its
choices never change greedy output. The cost model itself: tests/test_cost_model.py; one depth
for a runner that pads: tests/test_padding_runner.py."""

from __future__ import annotations

import pytest
from test_cost_model import _cached_curve, _never

from specdec import LLM, SamplingParams
from specdec.calibration import CALIBRATION_ROWS
from specdec.cost_model import Curve
from specdec.depth_plan import Alternative, Candidate, best_depths
from specdec.spec_control import (
    PRIOR_ACCEPT,
    PRIOR_ACCEPT_BY_METHOD,
    PROBE_EVERY,
    SpeculationController,
    geometric,
)


def test_a_draft_model_behind_a_long_prompt_starts_only_where_the_tokens_left_repay_it(
        tmp_path):
    # Rows cost 1 + 0.05 a row beyond 4, the draft model's pass 0.05 + 0.002 a row: drafting
    # pays step by step, but its first proposal feeds the 1,000-token prompt (2 s).
    c = SpeculationController()
    c.costs.calibrate(_never, 8, _cached_curve(tmp_path, "t.json",
                                               lambda r: 1.0 + 0.05 * max(0, r - 4)))
    c.costs.draft.calibrate("draft_model", _never, 128,
                              _cached_curve(tmp_path, "d.json", lambda r: 0.05 + 0.002 * r,
                                            CALIBRATION_ROWS))
    c.record_pass(4, 1.0)
    s = geometric(0.8, 4)
    assert c.costs.draft.catch_up_time("draft_model", 1000) == pytest.approx(0.002 * 998)

    def k(left: int) -> int:
        a = Alternative("draft_model", 4, 1, s, False, True,
                        start=c.start_cost("draft_model", 1000, left, s))
        return c.choose(4, 3, [Candidate("r", [a])])["r"].k

    assert k(8) == 0 and k(4000) > 0
    assert c.start_cost("draft_model", 2, 8, s) == 0.0  # a usual catch-up costs nothing more


def test_per_sequence_depths_follow_acceptance():
    alts = [Alternative("ngram", 4, 1, geometric(0.95, 4)),
            Alternative("ngram", 4, 1, geometric(0.1, 4))]
    ks, _ = best_depths(alts, 2, 0, lambda rows: 1.0 + 0.1 * rows, lambda m, n, d: 0.0)
    assert ks[0] == 4 and ks[1] == 0


def test_a_costly_draft_model_is_not_tried_where_it_cannot_pay(tmp_path):
    # 4 rows cost 1, every further row 0.05: drafting pays while the drafter is thought free;
    # a draft model pass costs 0.5, and then it does not.
    def controller(calibrated: bool) -> SpeculationController:
        c = SpeculationController()
        c.costs.calibrate(_never, 8, _cached_curve(tmp_path, "t.json",
                                                   lambda r: 1.0 + 0.05 * max(0, r - 4)))
        if calibrated:
            c.costs.draft.calibrate("draft_model", _never, 8,
                                      _cached_curve(tmp_path, "d.json", lambda r: 0.5))
        c.record_pass(4, 1.0)
        return c

    cands = [cand(str(i), "draft_model") for i in range(4)]
    assert any(ch.k > 0 for ch in controller(False).choose(4, 0, cands).values())
    assert all(ch.k == 0 for ch in controller(True).choose(4, 0, cands).values())


def cand(rid, method="ngram", k=4, survival=None, lookup=None):
    return Candidate(rid, [Alternative(method, k, 1, survival or geometric(0.6, k),
                                       method == "ngram" if lookup is None else lookup)])


def test_controller_measures_plain_first_then_explores_then_keeps_what_pays():
    c = SpeculationController()
    assert c.choose(1, 0, [cand("a")])["a"].k == 0  # nothing measured: plain first
    c.record_pass(1, 1.0)
    assert c.choose(1, 0, [cand("a")])["a"].k == 4  # a larger pass is assumed no dearer
    c.record_pass(5, 1.1)  # cheap verification (a GPU): keep speculating
    assert c.choose(1, 0, [cand("a")])["a"].k == 4


def test_acceptance_zero_turns_speculation_off_and_recovers():
    c = SpeculationController()
    for rows in (1, 2, 3, 4, 5):
        c.record_pass(rows, 1.0 + 0.3 * (rows - 1))  # each row costs 30% of a pass (a CPU)

    def depth() -> int:
        return c.choose(1, 0, [cand("a", survival=c.survival("a", "ngram", 4))])["a"].k

    for _ in range(20):
        c.verified("a", "ngram", 4, 4, 5)
    assert depth() > 0
    for _ in range(20):
        c.verified("a", "ngram", 4, 0, 1)
    ks = []
    for _ in range(PROBE_EVERY * 6):
        ks.append(depth())
        if ks[-1]:
            c.verified("a", "ngram", ks[-1], 0, 1)  # every draft rejected
    # Off, but for the probes and a retry when the rejections have faded (IDLE_DECAY).
    assert len(ks) - 8 <= ks.count(0) < len(ks)
    for _ in range(20):
        c.verified("a", "ngram", 1, 1, 2)
    assert depth() > 0


def test_a_sequence_kept_plain_comes_back_to_its_drafters_profile():
    """Rejections of the past fade while a sequence is kept plain (IDLE_DECAY a step), so a
    stretch of misses does not keep it off for good where its drafter pays."""
    c = SpeculationController()
    for _ in range(50):
        c.verified("b", "ngram", 4, 4, 5)  # the drafter's profile over every request: good
    for _ in range(10):
        c.verified("a", "ngram", 4, 0, 1)  # this request: a stretch of misses
    low = c.survival("a", "ngram", 4)[0]
    profile = c.survival("new", "ngram", 4)[0]
    assert low < 0.5 < profile
    for _ in range(60):
        c.hold_step() or c.choose(1, 1, [])  # steps that verify nothing of "a"
    # Where drafting again costs a catch-up (a draft model behind), the evidence stands.
    assert c.survival("a", "ngram", 4, fade=False)[0] == low
    back = c.survival("a", "ngram", 4)[0]
    assert low < back <= profile
    c.verified("a", "ngram", 4, 0, 1)
    assert c.survival("a", "ngram", 4)[0] < back  # new evidence counts in full


def test_probes_start_a_drafter_behind_on_a_sequence_only_where_its_catch_up_is_cheap():
    # The drafter's profile over every request says no (a stretch of bad traffic): a new
    # request, which its draft model has not read, gets evidence of its own only from probes.
    def controller() -> SpeculationController:
        c = SpeculationController()
        for rows in (1, 2, 3, 4, 5):
            c.record_pass(rows, 1.0 + 0.3 * (rows - 1))
        for _ in range(20):
            c.verified("old", "draft_model", 4, 0, 1)
        return c

    def probed(catch_up: float, c: SpeculationController | None = None) -> int:
        c = c or controller()
        s = c.survival("new", "draft_model", 4)
        a = Alternative("draft_model", 4, 1, s, False, True, catch_up)
        return sum(c.choose(1, 0, [Candidate("new", [a])])["new"].k > 0
                   for _ in range(PROBE_EVERY * 2))

    # Plain steps of 1.3 s: probes start it where its catch-up costs at most a quarter of
    # the 32 steps between probes (10.4 s).
    assert probed(0.5) == 2 and probed(10.0) == 2
    assert probed(30.0) == 0  # a long prompt: never started by a probe
    # Probes that keep finding the same choice come less often (up to PROBE_MAX apart), and
    # a longer period affords a dearer catch-up.
    c = controller()
    assert probed(10.0, c) == 2 and probed(30.0, c) == 1
    c.forget_evidence()
    prior = PRIOR_ACCEPT_BY_METHOD["draft_model"]
    assert c.survival("new", "draft_model", 4) == geometric(prior, 4)
    assert c.stats == {}


def test_host_work_per_drafting_sequence_turns_speculation_off_and_back_on():
    # A GPU at batch 16: more rows nearly free, so only the host work of each drafting
    # sequence (made dear for a while) can make speculation lose to plain decoding.
    batch = 16
    c = SpeculationController()
    cands = [cand(f"r{i}", survival=geometric(0.6, 4)) for i in range(batch)]
    c.record_pass(batch, 1.0 + 0.001 * batch)

    def run(steps: int, per_seq: float) -> list[int]:
        drafting = []
        for _ in range(steps):
            ks = [ch.k for ch in c.choose(batch, 0, cands).values()]
            s = sum(1 for k in ks if k)
            rows = batch + sum(ks)
            c.record_pass(rows, 1.0 + 0.001 * rows + per_seq * s, s)
            drafting.append(s)
        return drafting

    assert run(40, 0.001)[-20:] == [batch] * 20  # cheap: every sequence drafts
    dear = run(400, 0.2)[-300:]  # 16 drafting cost 3.2 passes: off, but for probes,
    # which back off while they keep finding it off (32, 64, then 128 steps apart)
    assert sum(1 for s in dear if s > 1) <= 5 and sum(1 for s in dear if s == 1) >= 2
    assert run(300, 0.001)[-40:] == [batch] * 40  # cheap again: measured, and back on


def test_auto_picks_the_better_drafter_and_falls_back_from_a_lookup():
    c = SpeculationController()
    for rows in (1, 2, 4, 8):
        c.record_pass(rows, 1.0 + 0.05 * rows)
    c.record_draft("draft_model", 1, 4, 0.4)  # 0.1 s per depth

    def auto(ngram: float, model: float) -> Candidate:
        return Candidate("a", [Alternative("ngram", 4, 1, geometric(ngram, 4), True),
                               Alternative("draft_model", 4, 1, geometric(model, 4))])

    ch = c.choose(1, 0, [auto(0.9, 0.6)])["a"]
    assert ch.alternative == 0 and ch.k > 0  # the lookup, when it matches
    assert ch.fallback == 1 and ch.fallback_k > 0  # the model when it does not
    ch = c.choose(1, 0, [auto(0.2, 0.8)])["a"]
    assert ch.alternative == 1 and ch.k > 0 and ch.fallback is None


def test_auto_weighs_a_free_lookup_against_the_tokens_a_dearer_drafter_finds():
    # The 2-core CPU: 1-5 rows cost about one 40 ms pass, the draft model 10 ms a depth. The
    # lookup's 0.3 first-position acceptance is free, but 4 deep the draft model's 0.9 emits
    # 1 + 3.1 tokens in 80 ms against 1.4 in 40: the draft model is the faster.
    c = SpeculationController()
    for rows, ms in ((1, 40), (2, 40), (3, 40), (4, 41), (5, 42), (6, 55)):
        c.record_pass(rows, ms / 1e3)
    c.record_draft("draft_model", 1, 4, 0.040)
    cands = [Candidate("a", [Alternative("ngram", 4, 1, geometric(0.3, 4), True),
                             Alternative("draft_model", 4, 1, geometric(0.9, 4))])]
    ch = c.choose(1, 0, cands)["a"]
    assert ch.alternative == 1 and ch.k == 4


def test_stats_compare_predicted_and_emitted_tokens():
    c = SpeculationController()
    c.record_pass(1, 1.0)
    ch = c.choose(1, 0, [cand("a", survival=[0.5, 0.25, 0.1, 0.05])])["a"]
    c.verified("a", "ngram", ch.k, 2, 3)
    st = c.stats["ngram"].to_dict()
    assert st["depth_histogram"] == {str(ch.k): 1} and st["emitted_tokens"] == 3
    assert st["predicted_tokens"] == pytest.approx(1 + sum([0.5, 0.25, 0.1, 0.05][:ch.k]))


def test_a_fixed_k_teaches_its_drafters_profile_but_is_no_choice_of_the_controller():
    c = SpeculationController()
    for _ in range(30):
        c.verified("fixed", "ngram", 4, 4, 5, chosen=False)  # every draft accepted
    assert "ngram" not in c.stats  # the controller chose none of them
    assert ("fixed", "ngram") not in c.evidence.seqs  # no estimate of its own
    assert c.survival("new", "ngram", 4)[0] > 0.9  # ... but the profile learnt
    c.record_pass(1, 1.0)
    ch = c.choose(1, 0, [cand("a", survival=c.survival("a", "ngram", 4))])["a"]
    c.verified("a", "ngram", ch.k, ch.k, ch.k + 1)
    assert c.stats["ngram"].steps == 1


def test_adaptive_engine_keeps_greedy_output(tiny_llama):
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9]]
    ref = LLM(model=str(tiny_llama), speculative={"method": "none"}).generate(prompts, p)
    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram"},
              adaptive_speculation=True)
    outs = llm.generate(prompts, p)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.drafting.controller.costs.measured  # costs were measured


def test_engine_records_how_many_sequences_of_a_step_drafted(tiny_llama, monkeypatch):
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7, 8]]
    for method in ("none", "ngram"):
        llm = LLM(model=str(tiny_llama), speculative={"method": method,
                                                     "num_speculative_tokens": 3})
        steps: list[tuple[int, int]] = []

        def record(rows: int, seconds: float, speculating: int = 0, chained: bool = False,
                   batch: int = 0, deepest: int = 0, add=steps.append) -> None:
            add((rows, speculating))

        monkeypatch.setattr(llm.engine.drafting.controller, "record_pass", record)
        llm.generate(prompts, p)
        assert steps and all(0 <= s <= len(prompts) for _, s in steps)
        assert all(rows >= 2 * s for rows, s in steps)  # a root and a draft node at least
        assert all(rows <= len(prompts) * 7 for rows, _ in steps)  # no prefill (20 rows)
        drafted = sum(1 for _, s in steps if s)
        assert drafted == 0 if method == "none" else drafted > 0


def test_warm_up_leaves_the_costs_and_forgets_the_acceptance(tiny_llama):
    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram"},
              adaptive_speculation=True)
    c = llm.engine.drafting.controller
    c.verified("earlier", "ngram", 4, 0, 1)
    llm.engine.warm_up()
    assert c.costs.measured  # the warm-up's steps were timed ...
    assert c.survival("next", "ngram", 4) == geometric(PRIOR_ACCEPT, 4)  # ... nothing else kept
    assert c.stats == {} and llm.engine.spec_totals == {}
    assert not llm.engine.has_unfinished()


def test_probes_skip_a_drafter_that_could_not_pay_even_if_every_token_were_accepted():
    # At batch 8 a plain step costs 1.0 s for 8 tokens and each row beyond it 0.2 s: more than
    # the 0.125 s a token plain decoding pays, so no acceptance could make drafting pay, and
    # probes (which would first feed a draft model behind on the sequence) leave it off. At
    # batch 1, with rows at 0.05 s, they still start it.
    def probed(batch: int, per_row: float) -> int:
        c = SpeculationController()
        for rows in range(1, 2 * batch + 9):
            c.record_pass(rows, 1.0 + per_row * max(0, rows - batch))
        for _ in range(20):
            c.verified("old", "draft_model", 4, 0, 1)
        s = c.survival("new", "draft_model", 4)
        cands = [Candidate(f"r{j}", [Alternative("draft_model", 4, 1, s, False, True, 0.1)])
                 for j in range(batch)]
        return sum(ch.k > 0 for _ in range(PROBE_EVERY * 2)
                   for ch in c.choose(batch, 0, cands).values())

    assert probed(1, 0.05) == 2
    assert probed(8, 0.2) == 0


def test_one_rejected_draft_does_not_turn_off_a_request_whose_drafter_accepts_well():
    # The 2-core CPU's costs as a server measured them (a plain step 30 ms, 5 rows 46 ms, the
    # draft model 10.6 ms for its first token and about 8 ms for each further one) and a draft
    # model profile from earlier requests (two of three drafts accepted 3-4 deep, the third
    # not at all: 0.67 at the first position). A new request
    # whose first draft is rejected outright keeps drafting: one verification is not enough
    # evidence against a drafter that accepts well elsewhere. Its own evidence still rules
    # once it has some: a run of rejections turns it off. (That firmer start is a calibrated
    # model drafter's, which falls behind while it is off; a lookup's evidence fades back
    # while it is kept plain, and one rejection weighs as much as it always did.)
    c = SpeculationController()
    for rows, ms in zip(range(1, 6), (30.2, 34.1, 40.8, 41.4, 46.2)):
        c.record_pass(rows, ms / 1e3)
    for depth, ms in zip(range(1, 5), (10.6, 21.8, 27.0, 34.8)):
        c.record_draft("draft_model", 1, depth, ms / 1e3)
    model_pass = Curve(proportional=True)
    for rows, ms in ((1, 8.7), (2, 10.5), (64, 110.0)):
        model_pass.record(rows, ms / 1e3)
    c.costs.draft.calibration["draft_model"] = model_pass
    for method in ("draft_model", "ngram"):
        for _ in range(200):
            c.verified("earlier", method, 4, 3, 4)
            c.verified("earlier", method, 4, 4, 5)
            c.verified("earlier", method, 4, 0, 1)
        c.verified("once", method, 4, 0, 1)
    model, lookup = (c.survival("once", m, 1)[0] for m in ("draft_model", "ngram"))
    assert model > 0.55 and lookup < 0.46  # the profile 0.67: (5.4 * 0.67) / 6.4, (2 * 0.67) / 3

    def depth() -> int:
        s = c.survival("new", "draft_model", 4)
        cand = Candidate("new", [Alternative("draft_model", 4, 1, s)])
        return c.choose(1, 0, [cand])["new"].k

    assert depth() >= 3
    c.verified("new", "draft_model", 4, 0, 1)
    assert depth() > 0
    for _ in range(4):
        c.verified("new", "draft_model", 4, 0, 1)
    assert depth() == 0


def test_costs_measured_in_a_slow_spell_follow_the_machine_when_it_speeds_up(tmp_path):
    # The 2-core CPU's pace moves by half within minutes. A request drafts through a slow spell
    # (every pass 1.5x), then plain steps (a request with speculation off) find the machine
    # fast again. The draft depth's and the verification's costs, measured only while drafting,
    # must come down with the pace: set as they were against the new plain steps, drafting
    # (1.16x plain at this acceptance) reads as a loss and is not tried again.
    c = SpeculationController()
    c.costs.follows_pace = True  # as the engine sets it on the CPU
    c.costs.calibrate(_never, 8, _cached_curve(tmp_path, "t.json",
                                               lambda r: 0.030 + 0.004 * (r - 1)))
    c.costs.draft.calibrate("draft_model", _never, 8,
                              _cached_curve(tmp_path, "d.json", lambda r: 0.008 + 0.001 * r))
    slow = 1.5
    for _ in range(20):
        c.record_pass(1, 0.030 * slow)
    for _ in range(20):  # drafting 4 deep: a 5-row verification and 5 ms of host work
        c.record_pass(5, (0.046 + 0.005) * slow, 1)
        c.record_draft("draft_model", 1, 4, 0.036 * slow)
    for _ in range(40):
        c.record_pass(1, 0.030)
    # (While every step drafts, a step's host work reads as pace: 5 ms in 51, so what was
    # measured then is priced up to a tenth low.)
    assert c.costs.pass_time(1) == pytest.approx(0.030)
    assert c.costs.draft.time("draft_model", 1, 4) == pytest.approx(0.036, rel=0.12)
    assert c.costs.pass_time(5) + c.costs.spec_time(1) == pytest.approx(0.051, rel=0.12)
    alt = Alternative("draft_model", 4, 1, geometric(0.8, 4), False)
    assert c.choose(1, 0, [Candidate("r", [alt])])["r"].k >= 3


def test_the_pace_stays_anchored_on_a_steady_machine(tmp_path):
    # Two thousand steps on a machine whose speed does not change, each step's time off by up
    # to a quarter either way, drafting and plain in turns, proposals cut short at random (as
    # p_min cuts them). The pace is read against the calibration, not against the curves it
    # normalises; read against them it was a random walk (0.75 to 3.5 in one server's trace).
    import random

    rng = random.Random(3)
    c = SpeculationController()
    c.costs.follows_pace = True
    c.costs.calibrate(_never, 8, _cached_curve(tmp_path, "t.json",
                                               lambda r: 0.030 + 0.004 * (r - 1)))
    c.costs.draft.calibrate("draft_model", _never, 8,
                              _cached_curve(tmp_path, "d.json", lambda r: 0.008 + 0.001 * r))
    for step in range(2000):
        noise = rng.uniform(0.8, 1.25)
        if step % 200 < 100:
            c.record_pass(1, 0.030 * noise)
        else:
            c.record_pass(5, (0.046 + 0.005) * noise, 1)
            c.record_draft("draft_model", 1, 4, 0.009 * rng.randint(1, 4) * noise)
    assert 0.85 < c.costs.speed < 1.2
    assert c.costs.pass_time(1) == pytest.approx(0.030, rel=0.2)
