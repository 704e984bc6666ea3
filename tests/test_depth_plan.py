"""The choice of depths for one step (specdec/depth_plan.py) with made-up survivals and costs:
against brute force over every depth combination, and its shape as costs change."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.depth_plan import Alternative, best_depths, union_reach
from specdec.spec_control import geometric


def brute_force(alts, base, plain, pass_time, draft_time, host=lambda s: 0.0):
    """The best rate over every depth combination."""
    return max(rate_of(ks, alts, base, plain, pass_time, draft_time, host)
               for ks in itertools.product(*(range(a.max_k + 1) for a in alts)))


def rate_of(ks, alts, base, plain, pass_time, draft_time, host=lambda s: 0.0):
    """The rate of one depth combination: its tokens over its pass, the host work of its
    drafting sequences and its drafters' time."""
    gain = plain + len(alts) + sum(sum(a.survival[:k]) for a, k in zip(alts, ks))
    cost = pass_time(base + sum(a.rows(j) for a, k in zip(alts, ks) for j in range(k)))
    speculating = sum(1 for k in ks if k)
    cost += host(speculating) if speculating else 0.0
    cost += sum(a.start for a, k in zip(alts, ks) if k)
    for m in {a.method for a in alts}:
        depths = [k for a, k in zip(alts, ks) if a.method == m and k]
        cost += draft_time(m, len(depths), max(depths)) if depths else 0.0
    return gain / cost


def survival_curve(rng: random.Random, k: int) -> list[float]:
    s, out = 1.0, []
    for _ in range(k):
        s *= rng.uniform(0.0, 1.0)
        out.append(s)
    return out


def random_batch(rng: random.Random):
    """Up to four sequences of either drafter, a rising pass cost (concave or convex) and a
    draft model's cost (a catch-up pass, then one a depth)."""
    n = rng.randint(1, 4)
    methods = ["ngram", "draft_model"]
    alts = [Alternative(rng.choice(methods), rng.randint(0, 4), 1, []) for _ in range(n)]
    for a in alts:
        a.survival = survival_curve(rng, a.max_k)
    fixed, per_row, curve = rng.uniform(0.5, 2), rng.uniform(0.0, 0.6), rng.uniform(0, 0.05)
    first, more = rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.3)

    def pass_time(rows: int) -> float:
        return fixed + per_row * rows + curve * rows * rows

    def draft_time(m: str, _n: int, depth: int) -> float:
        return 0.0 if m == "ngram" else first + more * (depth - 1)

    base = n + rng.randint(0, 3)
    return alts, base, base - n, pass_time, draft_time


@pytest.mark.parametrize("seed", range(40))
def test_best_depths_equal_brute_force(seed):
    rng = random.Random(seed)
    alts, base, plain, pass_time, draft_time = random_batch(rng)
    start = rng.choice([0.0, rng.uniform(0.0, 0.5)])  # what speculating at all costs

    def host(s: int) -> float:
        return start if s else 0.0

    ks, rate = best_depths(alts, base, plain, pass_time, draft_time, spec_time=host)
    best = brute_force(alts, base, plain, pass_time, draft_time, host)
    assert rate == pytest.approx(best, rel=1e-9)
    assert rate_of(ks, alts, base, plain, pass_time, draft_time, host) == pytest.approx(
        best, rel=1e-9)
    assert all(0 <= k <= a.max_k for k, a in zip(ks, alts))


def test_best_depths_near_brute_force_with_host_work_per_drafting_sequence():
    # Host work per drafting sequence: one sequence drafted deep can beat two drafted shallow,
    # which the greedy over rows alone does not see; the bundle order keeps within 0.5%.
    ignoring = 0
    for seed in range(400):
        rng = random.Random(seed)
        alts, base, plain, pass_time, draft_time = random_batch(rng)
        start, per_seq = rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.5)

        def host(s: int, start: float = start, per_seq: float = per_seq) -> float:
            return start + per_seq * s

        ks, rate = best_depths(alts, base, plain, pass_time, draft_time, spec_time=host)
        best = brute_force(alts, base, plain, pass_time, draft_time, host)
        assert rate == pytest.approx(rate_of(ks, alts, base, plain, pass_time, draft_time,
                                             host), rel=1e-9)
        assert best * (1 - 0.005) <= rate <= best * (1 + 1e-9)
        blind, _ = best_depths(alts, base, plain, pass_time, draft_time)
        ignoring += rate_of(blind, alts, base, plain, pass_time, draft_time, host) < (
            best * (1 - 0.005))
    assert ignoring > 40  # plans that leave the host work out lose more, often


def test_best_depths_near_brute_force_with_a_start_cost_per_sequence():
    # A stale model drafter's catch-up, per sequence: another cost the greedy over rows does
    # not see, priced into each sequence's bundle.
    for seed in range(400):
        rng = random.Random(seed)
        alts, base, plain, pass_time, draft_time = random_batch(rng)
        for a in alts:
            a.start = rng.choice([0.0, rng.uniform(0.0, 1.0)])
        per_seq = rng.choice([0.0, rng.uniform(0.0, 0.5)])

        def host(s: int, per_seq: float = per_seq) -> float:
            return per_seq * s

        ks, rate = best_depths(alts, base, plain, pass_time, draft_time, spec_time=host)
        best = brute_force(alts, base, plain, pass_time, draft_time, host)
        assert rate == pytest.approx(rate_of(ks, alts, base, plain, pass_time, draft_time,
                                             host), rel=1e-9)
        assert best * (1 - 0.005) <= rate <= best * (1 + 1e-9)


@pytest.mark.parametrize("curved", [False, True])
def test_best_depths_with_drafters_that_stop_short(curved):
    # A draft model that may stop short adds a row at position j only where it drafts that
    # deep (D_j): rows cost by that expectation, and a deeper position can then be worth more
    # per row than a shallower one. On a pass linear in rows the plan is the brute force's;
    # on a curved one within 0.5%.
    for seed in range(300):
        rng = random.Random(seed)
        alts, base, plain, pass_time, draft_time = random_batch(rng)
        if not curved:
            fixed, per_row = rng.uniform(0.5, 2), rng.uniform(0.0, 0.6)

            def pass_time(rows: float, fixed: float = fixed, per_row: float = per_row) -> float:
                return fixed + per_row * rows
        for a in alts:
            a.reach = [1.0] + survival_curve(rng, a.max_k)[:max(0, a.max_k - 1)]
            a.survival = [s * d for s, d in zip(a.survival, a.reach)]  # accepted: drafted
        ks, rate = best_depths(alts, base, plain, pass_time, draft_time)
        best = brute_force(alts, base, plain, pass_time, draft_time)
        assert rate == pytest.approx(rate_of(ks, alts, base, plain, pass_time, draft_time),
                                     rel=1e-9)
        if curved:
            assert best * (1 - 0.005) <= rate <= best * (1 + 1e-9)
        else:
            assert rate == pytest.approx(best, rel=1e-9)


def test_asking_deeper_of_a_drafter_that_stops_short_costs_its_expected_rows():
    # Every row costs a pass: 4 deep asked, priced as 4 rows, never pays at acceptance below
    # 1; priced by where the drafter stops (one token in two, then rarely), it does, and the
    # scan takes the deep, sure positions after the first.
    surv, reach = [0.5, 0.09, 0.09, 0.09], [1.0, 0.1, 0.1, 0.1]
    sure = Alternative("draft_model", 4, 1, surv)
    ks, _ = best_depths([sure], 1, 0, lambda rows: 1.0 + rows, lambda m, n, d: 0.0)
    assert ks == [0]
    sure.reach = reach
    ks, _ = best_depths([sure], 1, 0, lambda rows: 1.0 + rows, lambda m, n, d: 0.0)
    assert ks == [4]


def test_a_batch_runs_a_draft_pass_where_any_of_its_sequences_drafts_that_deep():
    # Two sequences that each draft a second token half the time: the batch's second pass runs
    # three times in four; n = 1 prices the likelier sequence alone.
    u = union_reach([[1.0, 0.5, 0.2], [1.0, 0.5, 0.4, 0.1]])
    assert u[0] == pytest.approx([1.0, 0.5, 0.4, 0.1])
    assert u[1] == pytest.approx([1.0, 0.75, 0.52, 0.1])


def test_free_verification_drafts_deep_and_expensive_drafts_not_at_all():
    alts = [Alternative("ngram", 4, 1, geometric(0.8, 4))]
    ks, _ = best_depths(alts, 1, 0, lambda rows: 1.0, lambda m, n, d: 0.0)
    assert ks == [4]  # a GPU at batch 1: more rows cost nothing
    ks, _ = best_depths(alts, 1, 0, lambda rows: float(rows), lambda m, n, d: 0.0)
    assert ks == [0]  # every row costs a whole pass: never worth it below acceptance 1


def test_depths_fall_smoothly_with_the_batch():
    # Costs like a GPU: flat up to a knee, then linear. Deep at small batches, shallower as
    # the batch grows, never deeper; the rate never falls as the batch grows and never below
    # plain decoding's: no batch size where a switch costs throughput.
    def pass_time(rows: int) -> float:
        return max(1.0, rows / 32)

    means, rates = [], []
    for batch in range(1, 65):
        alts = [Alternative("ngram", 6, 1, geometric(0.7, 6)) for _ in range(batch)]
        ks, rate = best_depths(alts, batch, 0, pass_time, lambda m, n, d: 0.0)
        means.append(sum(ks) / batch)
        rates.append(rate)
        assert rate >= batch / pass_time(batch)
    assert means[0] == 6 and means[-1] < 2
    assert all(b <= a + 1e-9 for a, b in zip(means, means[1:]))
    assert all(b >= a - 1e-9 for a, b in zip(rates, rates[1:]))
