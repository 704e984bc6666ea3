"""Acceptance evidence (specdec/acceptance.py): per-position estimates that follow recent
verifications and never grow with depth, a draft model's reach, and a request's own evidence
counted once against its drafter's profile."""

from __future__ import annotations

import pytest

from specdec.acceptance import Acceptance, geometric
from specdec.spec_control import SpeculationController


def test_acceptance_is_recency_weighted_and_monotone():
    acc = Acceptance()
    for _ in range(30):
        acc.observe(4, 4)
    assert acc.survival(4, geometric(0.5, 4))[-1] > 0.8
    for _ in range(30):
        acc.observe(4, 0)  # acceptance collapses: it shows within a few verifications
    assert acc.survival(4, geometric(0.5, 4))[0] < 0.15
    s = acc.survival(6, geometric(0.9, 6))
    assert all(b <= a for a, b in zip(s, s[1:]))
    acc.observe(0, 0)  # nothing drafted: nothing learnt
    assert acc.survival(6, geometric(0.9, 6)) == s


def test_a_draft_models_reach_is_learnt_from_where_it_stopped_short():
    # Asked 3 deep, the drafter drafted 1 token in four verifications of five, 3 in the fifth:
    # D_1 is 1 (the first pass always drafts a token), D_2 and D_3 fall towards 0.2 (a recent
    # 3 weighs most, and the prior of never stopping counts 2 against about 10); a drafter
    # never seen stopping short keeps 1 everywhere.
    ctl = SpeculationController()
    for _ in range(8):
        for drafted in (1, 1, 1, 1, 3):
            ctl.verified("r", "draft_model", 3, min(drafted, 1), 2, drafted)
    d = ctl.reach("r", "draft_model", 3)
    assert d[0] == pytest.approx(1.0)
    assert 0.15 < d[1] < 0.45 and d[2] <= d[1]
    assert ctl.reach("r", "eagle", 3) == [1.0, 1.0, 1.0]
    # ... and its survival counts the positions it did not draft as rejected
    assert ctl.survival("r", "draft_model", 2)[1] < 0.35


def test_a_requests_own_verifications_count_once_in_its_estimate():
    # Alone on a fresh server a request's drafter profile is all its own: its prior is the
    # profile less its part, so four rejections weigh once (0.6 prior worth 2 against 3.44 of
    # decayed evidence: 0.22), not twice (0.07, and the request went plain where drafting paid).
    ctl = SpeculationController()
    for _ in range(4):
        ctl.verified("a", "ngram", 8, 0, 1)
    offered = sum(0.9 ** i for i in range(4))
    alone = 2 * 0.6 / (offered + 2)
    assert ctl.survival("a", "ngram", 1)[0] == pytest.approx(alone)
    # Another request's verifications are evidence for it, through the profile: its prior
    # falls below 0.6, and it is the profile with "a"'s part left out.
    for _ in range(6):
        ctl.verified("b", "ngram", 8, 0, 1)
    ev = ctl.evidence
    prior_a = ev.drafters["ngram"].survival(1, [0.6], ev.shares[("a", "ngram")])[0]
    b_part = sum(0.995 ** i for i in range(6))
    assert prior_a == pytest.approx(2 * 0.6 / (b_part + 2), rel=1e-9)
    assert ctl.survival("a", "ngram", 1)[0] == pytest.approx(2 * prior_a / (offered + 2))
    # A request gone leaves its part in the profile for those after it.
    ctl.forget("a")
    assert ctl.survival("c", "ngram", 1)[0] < prior_a


def test_a_share_too_small_to_matter_is_left_in():
    # Among 100 requests one's share of the profile is 1%: every request then asks the same
    # survival of the profile, computed once (the controller's host time at batch 128).
    ctl = SpeculationController()
    for i in range(100):
        ctl.verified(f"r{i}", "ngram", 4, i % 3, 1)
    ev = ctl.evidence
    profile = ev.drafters["ngram"]
    whole = profile.survival(4, [0.6] * 4)
    assert profile.survival(4, [0.6] * 4, ev.shares[("r7", "ngram")]) == whole
    # ... where one request's share is not: left out, its full acceptances lift its prior no more
    for _ in range(40):
        ctl.verified("big", "ngram", 4, 4, 5)
    with_big = profile.survival(4, [0.6] * 4)
    assert profile.survival(4, [0.6] * 4, ev.shares[("big", "ngram")])[3] < with_big[3] - 0.1


def test_deeper_positions_without_evidence_follow_at_least_the_priors_conditional():
    # Drafted only one deep so far: position 2 has no evidence of its own. The first position's
    # acceptance is no conditional (and the lowest one, in every profile measured): position 2
    # is judged by the first's estimate times the larger of it and the prior's conditional.
    prior = geometric(0.6, 4)
    low, high = Acceptance(), Acceptance()
    for i in range(40):
        low.observe(1, int(i % 10 < 3))  # 0.3 at the first position
        high.observe(1, int(i % 10 < 9))  # 0.9
    s = low.survival(4, prior)
    assert s[1] == pytest.approx(s[0] * 0.6) and s[2] == pytest.approx(s[1] * 0.6)
    t = high.survival(4, prior)
    assert t[1] == pytest.approx(t[0] * t[0])  # its own rate, above the prior's 0.6
    # Evidence at position 2 gives a conditional of its own, which then carries on.
    for _ in range(40):
        low.observe(2, 0)
    s = low.survival(4, prior)
    assert s[2] <= s[1] * (s[1] / s[0]) + 1e-9
