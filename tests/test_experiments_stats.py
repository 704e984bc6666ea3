"""The A/B statistics: each estimator against values worked out by hand on small inputs, the
A/A calibration of the confidence sequence against the peeked fixed-horizon interval, and the
sample-ratio-mismatch check."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from experiments.estimators import (
    RatioSums,
    cs_halfwidth,
    fixed_halfwidth,
    lift,
    ratio,
    srm,
    t_interval,
    welch,
)
from experiments.record import RequestRecord
from experiments.stats import confidence_sequence_history, summarize

Z = 1.959963984540054  # the standard normal's 0.975 quantile
Z80 = 0.8416212335729143  # its 0.8 quantile


def rec(arm: str, accepted: int, drafted: int, steps: int, i: int = 0, **kw) -> RequestRecord:
    base = dict(experiment="e", arm=arm, unit=f"u{i}", request_id=f"{arm}-{i}", slot=None,
                in_burn_in=False, finished_at=float(i), prompt_tokens=5,
                output_tokens=accepted + steps + 1, draft_tokens=drafted,
                accepted_tokens=accepted, steps=steps)
    return RequestRecord(**{**base, **kw})


# Control: (accepted, drafted) = (1, 2), (3, 4), (2, 6); treatment: (2, 2), (3, 4), (4, 6).
CONTROL = [rec("c", a, d, s, i) for i, (a, d, s) in enumerate([(1, 2, 1), (3, 4, 2), (2, 6, 2)])]
TREAT = [rec("t", a, d, s, i + 3) for i, (a, d, s) in enumerate([(2, 2, 1), (3, 4, 2),
                                                                  (4, 6, 2)])]


def test_ratio_of_sums_and_its_delta_method_variance_by_hand():
    # x = [1, 3, 2], y = [2, 4, 6]: R = 6/12; s_xx = 1, s_yy = 4, s_xy = 1 (ddof 1), ybar = 4:
    # Var(R) = (1 - 2 * 0.5 * 1 + 0.25 * 4) / (3 * 16) = 1/48.
    r, var = ratio(RatioSums.of([1, 3, 2], [2, 4, 6]))
    assert r == pytest.approx(0.5)
    assert var == pytest.approx(1 / 48)
    # Fewer than two units: no variance; no denominator: no ratio.
    assert math.isnan(ratio(RatioSums.of([1], [2]))[1])
    assert math.isnan(ratio(RatioSums.of([0, 0], [0, 0]))[0])


def test_summary_per_arm_by_hand():
    s = summarize(CONTROL + TREAT, control="c", arms=["c", "t"], weights={"c": 1, "t": 1},
                  design="request")
    c = s["arms"]["c"]
    assert (c["requests"], c["draft_tokens"], c["accepted_tokens"], c["steps"]) == (3, 12, 6, 5)
    assert c["acceptance_rate"]["estimate"] == pytest.approx(0.5)
    assert c["acceptance_rate"]["se"] == pytest.approx(math.sqrt(1 / 48))
    # tau: x = accepted + steps = [2, 5, 4], y = steps = [1, 2, 2]: tau = 11/5; s_xx = 7/3,
    # s_yy = 1/3, s_xy = 5/6, ybar = 5/3: Var = (7/3 - 2 * 2.2 * 5/6 + 2.2^2 / 3) / (3 * 25/9).
    assert c["tau"]["estimate"] == pytest.approx(2.2)
    var_tau = (7 / 3 - 2 * 2.2 * 5 / 6 + 2.2**2 / 3) / (3 * 25 / 9)
    assert c["tau"]["se"] == pytest.approx(math.sqrt(var_tau))
    json.dumps(s, allow_nan=False)  # JSON as it stands, no nan


def test_lift_intervals_and_sample_size_by_hand():
    s = summarize(CONTROL + TREAT, control="c", arms=["c", "t"], weights={}, design="request")
    a = s["comparisons"]["t"]["acceptance_rate"]
    # Treatment: R = 9/12 = 0.75, s_xx = 1, s_yy = 4, s_xy = 2: Var = (1 - 3 + 2.25) / 48.
    vt, vc = 0.25 / 48, 1 / 48
    var = vt / 0.5**2 + 0.75**2 * vc / 0.5**4
    assert a["lift"] == pytest.approx(0.5)
    assert a["se"] == pytest.approx(math.sqrt(var))
    assert a["fixed"] == pytest.approx([0.5 - Z * math.sqrt(var), 0.5 + Z * math.sqrt(var)])
    # The confidence sequence at n = 6 units in all, rho^2 = (-2 ln a + ln(1 - 2 ln a)) / 5000.
    la = -2 * math.log(0.05)
    rho2 = (la + math.log(la + 1)) / 5000
    n = 6
    half = math.sqrt(var * n * 2 * (n * rho2 + 1) / (n * n * rho2)
                     * math.log(math.sqrt(n * rho2 + 1) / 0.05))
    assert a["sequential"] == pytest.approx([0.5 - half, 0.5 + half])
    assert not a["significant_sequential"]
    # Per-arm per-unit variances 3 * vt and 3 * vc at mde 5%: (z + z80)^2 * s^2 / mde^2.
    s2 = 3 * vt / 0.5**2 + 0.75**2 * 3 * vc / 0.5**4
    need = math.ceil((Z + Z80) ** 2 * s2 / 0.05**2)
    assert a["required_per_arm"] == need
    assert a["remaining_per_arm"] == need - 3


def test_confidence_sequence_is_wider_than_fixed_and_shrinks():
    n = np.array([10, 100, 1000, 5000, 50000])
    var = 1.0 / n  # an estimator whose variance falls as 1/n
    cs, fixed = cs_halfwidth(var, n, 0.05), fixed_halfwidth(var, 0.05)
    assert np.all(cs > fixed)
    assert np.all(np.diff(cs) < 0)
    # Its width relative to the fixed interval is smallest near the tuning parameter.
    grid = np.logspace(1, 6, 400)
    rel = cs_halfwidth(1.0 / grid, grid, 0.05) / fixed_halfwidth(1.0 / grid, 0.05)
    assert 1000 < grid[np.argmin(rel)] < 25000


def test_control_without_drafts():
    control = [rec("none", 0, 0, s, i) for i, s in enumerate([4, 7, 9])]
    s = summarize(control + TREAT, control="none", arms=["none", "t"], weights={},
                  design="request")
    assert s["arms"]["none"]["tau"] == {"estimate": 1.0, "se": 0.0}
    assert s["arms"]["none"]["acceptance_rate"]["estimate"] is None
    assert s["comparisons"]["t"]["acceptance_rate"]["lift"] is None
    assert "control drafts no tokens" in s["comparisons"]["t"]["acceptance_rate"]["reason"]
    assert s["comparisons"]["t"]["tau"]["lift"] == pytest.approx(14 / 5 - 1)
    json.dumps(s, allow_nan=False)


def test_per_position_and_latency_percentiles():
    rs = [rec("c", 3, 6, 2, 0, accepted_per_position=[2, 1], drafted_per_position=[3, 3]),
          rec("c", 1, 2, 2, 1, accepted_per_position=[1], drafted_per_position=[2])]
    rs += [rec("c", 0, 0, 1, i, ttft_s=float(i - 1), tpot_s=float(i - 1) / 10)
           for i in range(2, 12)]  # ttft 1..10 s
    s = summarize(rs + TREAT, control="c", arms=["c", "t"], weights={}, design="request")
    pos = s["arms"]["c"]["per_position"]
    assert [p["accepted"] for p in pos] == [3, 1]
    assert [p["drafted"] for p in pos] == [5, 3]
    assert [p["rate"] for p in pos] == pytest.approx([3 / 5, 1 / 3])
    assert [p["per_step"] for p in pos] == pytest.approx([3 / 14, 1 / 14])
    lat = s["arms"]["c"]["latency"]
    assert lat["comparable"] is False
    assert (lat["ttft_s"]["p50"], lat["ttft_s"]["p90"], lat["ttft_s"]["p99"]) == \
        pytest.approx((5.5, 9.1, 9.91))
    # Two output tokens over ttft + tpot = 1.1 k s for k = 1..10: the median is the mean of
    # the 5th and 6th.
    assert lat["tokens_per_s"]["count"] == 10
    assert lat["tokens_per_s"]["p50"] == pytest.approx((2 / 5.5 + 2 / 6.6) / 2)
    assert s["arms"]["t"]["per_position"] == []


def test_switchback_slot_statistics_and_burn_in():
    rs = []
    # Arm "a" runs slots 0, 2, 4 with per-slot TPOT 10, 12, 14 ms; "b" slots 1, 3, 5 with 20,
    # 21, 25 ms. A burn-in record of absurd latency in each slot must not count.
    for slot, (arm, tpot) in enumerate([("a", 10), ("b", 20), ("a", 12), ("b", 21), ("a", 14),
                                        ("b", 25)]):
        for j in range(2):
            rs.append(rec(arm, 2, 4, 2, 10 * slot + j, slot=slot, tpot_s=tpot / 1e3,
                          ttft_s=0.1, finished_at=10.0 * slot + j))
        rs.append(rec(arm, 0, 4, 2, 10 * slot + 9, slot=slot, in_burn_in=True, tpot_s=9.0,
                      ttft_s=9.0))
    s = summarize(rs, control="a", arms=["a", "b"], weights={"a": 1, "b": 1},
                  design="switchback", slot_seconds=10.0)
    assert s["unit"] == "slot" and s["excluded_burn_in"] == 6
    a = s["arms"]["a"]
    assert a["latency"]["comparable"] is True
    assert a["acceptance_rate"]["estimate"] == pytest.approx(0.5)  # burn-in's 0/4 left out
    tp = a["slots"]["tpot_s"]
    h = stats.t.ppf(0.975, 2) * np.std([10, 12, 14], ddof=1) / math.sqrt(3) / 1e3
    assert tp["mean"] == pytest.approx(0.012)
    assert tp["ci"] == pytest.approx([0.012 - h, 0.012 + h])
    # Throughput: 2 requests of 5 output tokens per 10 s slot.
    assert a["slots"]["throughput"]["mean"] == pytest.approx(1.0)
    w = s["comparisons"]["b"]["latency"]["tpot_s"]
    ref = stats.ttest_ind([20, 21, 25], [10, 12, 14], equal_var=False)
    assert w["diff"] == pytest.approx(0.010)
    assert w["p_value"] == pytest.approx(ref.pvalue)
    ci = ref.confidence_interval(0.95)
    assert w["ci"] == pytest.approx([ci.low / 1e3, ci.high / 1e3])
    assert s["srm"]["counts"] == {"a": 3, "b": 3}


def test_welch_and_t_interval_against_scipy():
    rng = np.random.default_rng(3)
    x, y = rng.normal(1.0, 1.0, 9), rng.normal(0.5, 2.0, 14)
    w = welch(list(x), list(y), 0.1)
    ref = stats.ttest_ind(x, y, equal_var=False)
    ci = ref.confidence_interval(0.9)
    assert w["p_value"] == pytest.approx(ref.pvalue)
    assert w["ci"] == pytest.approx([ci.low, ci.high])
    t = t_interval(list(x), 0.05)
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    assert t["ci"] == pytest.approx([lo, hi])


def test_srm_matches_scipy_and_flags_a_skewed_split():
    counts = {"a": 520, "b": 480}
    out = srm(counts, {"a": 0.5, "b": 0.5})
    ref = stats.chisquare([520, 480], [500, 500])
    assert out["chi2"] == pytest.approx(ref.statistic)
    assert out["p_value"] == pytest.approx(ref.pvalue)
    assert not out["flagged"]
    three = srm({"a": 180, "b": 330, "c": 490}, {"a": 2, "b": 3, "c": 5})
    assert three["p_value"] == pytest.approx(stats.chisquare([180, 330, 490],
                                                             [200, 300, 500]).pvalue)
    # A 53/47 split of 10,000 requests meant to be 50/50: chi2 = 36, p ~ 2e-9.
    rng = np.random.default_rng(0)
    arm = rng.random(10_000) < 0.53
    skew = srm({"a": int(arm.sum()), "b": int((~arm).sum())}, {"a": 1, "b": 1})
    assert skew["flagged"] and skew["p_value"] < 1e-6
    # Correct splits are flagged at about the 0.001 rate: 1000 draws of a 20/30/50 split
    # flag more than 5 with probability 6e-4.
    draws = rng.multinomial(2000, [0.2, 0.3, 0.5], size=1000)
    flagged = sum(srm(dict(zip("abc", map(int, d))), {"a": 2, "b": 3, "c": 5})["flagged"]
                  for d in draws)
    assert flagged <= 5
    # An arm of weight 0 that received traffic is a mismatch outright.
    assert srm({"a": 10, "b": 10, "c": 1}, {"a": 1, "b": 1, "c": 0})["flagged"]


@pytest.mark.parametrize("metric", ["acceptance_rate", "tau"])
def test_aa_calibration_confidence_sequence_vs_peeked_fixed_interval(metric):
    """400 A/A experiments of 2000 requests each, watched after every batch of 20 (100 looks).
    A false positive is any look whose interval excludes zero lift. With its true rate at
    alpha, the count of 400 exceeds binom(400, alpha)'s 0.99 quantile (29) with probability
    under 1%: the confidence sequence must stay at or under that bound, the peeked
    fixed-horizon interval must exceed it, and the fixed interval read once at the end
    must not."""
    sims, n, batch, alpha = 400, 2000, 20, 0.05
    rng = np.random.default_rng(20240526)
    steps = rng.integers(5, 40, size=(sims, n))
    drafted = 4 * steps
    # Each request has its own acceptance probability, so that clustering by request matters.
    accepted = rng.binomial(drafted, rng.beta(4, 2, size=(sims, n)))
    x, y = (accepted, drafted) if metric == "acceptance_rate" else (accepted + steps, steps)
    treated = rng.random((sims, n)) < 0.5
    t = RatioSums.of(x, y, treated, axis=1, cumulative=True)
    c = RatioSums.of(x, y, ~treated, axis=1, cumulative=True)
    (rt, vt), (rc, vc) = ratio(t), ratio(c)
    est, var = lift(rt, vt, rc, vc)  # [sims, n]
    looks = np.arange(batch - 1, n, batch)
    est, var = est[:, looks], var[:, looks]
    assert np.isfinite(var).all()
    miss_fixed = np.abs(est) > fixed_halfwidth(var, alpha)
    miss_cs = np.abs(est) > cs_halfwidth(var, looks + 1, alpha)
    bound = stats.binom.ppf(0.99, sims, alpha)
    assert miss_cs.any(axis=1).sum() <= bound
    assert miss_fixed.any(axis=1).sum() > bound
    assert miss_fixed[:, -1].sum() <= bound


def test_confidence_sequence_history_ends_at_the_summary():
    rng = np.random.default_rng(1)
    rs = []
    for i in range(600):
        arm = "t" if rng.random() < 0.5 else "c"
        d = int(rng.integers(4, 20))
        rs.append(rec(arm, int(rng.binomial(d, 0.6 if arm == "t" else 0.5)), d, d // 4 + 1, i,
                      finished_at=1000.0 + i))
    h = confidence_sequence_history(rs[::-1], "c", "t", "acceptance_rate", 0.05)
    assert 100 < len(h) <= 200
    assert [p["n"] for p in h] == sorted({p["n"] for p in h})
    assert h[-1]["n"] == 600
    s = summarize(rs, control="c", arms=["c", "t"], weights={}, design="request")
    a = s["comparisons"]["t"]["acceptance_rate"]
    assert h[-1]["lift"] == pytest.approx(a["lift"])
    assert h[-1]["sequential"] == pytest.approx(a["sequential"])
    assert h[-1]["fixed"] == pytest.approx(a["fixed"])
    assert all(p["sequential"][0] <= p["fixed"][0] <= p["lift"] for p in h)
    json.dumps(h, allow_nan=False)


def test_bad_design_or_control():
    with pytest.raises(ValueError, match="design"):
        summarize(CONTROL, control="c", arms=["c", "t"], weights={}, design="bandit")
    with pytest.raises(ValueError, match="control"):
        summarize(CONTROL, control="x", arms=["c", "t"], weights={}, design="request")
