"""The estimators behind the A/B statistics, written on sums so that they broadcast.

A ratio metric (acceptance rate = accepted / drafted, tau = emitted / steps) is a ratio of two
sums over independent units (requests, or switchback slots). Its variance is the delta method's,
clustered by unit, as GrowthBook's ratio metrics:

    R = sum x / sum y,   Var(R) ~ (s_xx - 2 R s_xy + R^2 s_yy) / (n * ybar^2)

with s the unit-level sample (co)variances. Every function takes floats or numpy arrays of the
same shape (the A/A calibration test evaluates thousands of peeks in one call) and returns nan
where a value is undefined (no units, no denominator); `stats.py` turns nan into None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

# The confidence sequence is tightest when the total number of units reaches this (GrowthBook's
# default "sequential testing tuning parameter"). Smaller values narrow it early and widen it
# late; any value keeps the time-uniform guarantee.
CS_TUNING = 5000.0


@dataclass(frozen=True)
class RatioSums:
    """Sufficient statistics of a ratio metric over n units: sums of x, y, x^2, y^2 and x*y."""

    n: Any
    sx: Any
    sy: Any
    sxx: Any
    syy: Any
    sxy: Any

    @classmethod
    def of(cls, x: Any, y: Any, mask: Any = None, axis: int = -1,
           cumulative: bool = False) -> RatioSums:
        """The sums over `axis` of the units where `mask` holds (all units without a mask);
        with `cumulative`, the running sums after each unit, for watching an experiment."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        m = np.ones_like(x) if mask is None else np.asarray(mask, dtype=np.float64)
        add = np.cumsum if cumulative else np.sum
        x, y = x * m, y * m
        return cls(add(m, axis=axis), add(x, axis=axis), add(y, axis=axis),
                   add(x * x, axis=axis), add(y * y, axis=axis), add(x * y, axis=axis))


def ratio(s: RatioSums) -> tuple[Any, Any]:
    """(R, Var(R)): the ratio of sums and its delta-method variance, clustered by unit."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.asarray(s.n, dtype=np.float64)
        r = s.sx / s.sy
        var_x = (s.sxx - s.sx * s.sx / n) / (n - 1)
        var_y = (s.syy - s.sy * s.sy / n) / (n - 1)
        cov = (s.sxy - s.sx * s.sy / n) / (n - 1)
        ybar = s.sy / n
        var = (var_x - 2 * r * cov + r * r * var_y) / (n * ybar * ybar)
        # Rounding can leave a tiny negative where the ratio is constant across units.
        var = np.where(n >= 2, np.maximum(var, 0.0), np.nan)
    return r, var


def lift(r_t: Any, var_t: Any, r_c: Any, var_c: Any) -> tuple[Any, Any]:
    """(r_t / r_c - 1, its variance): the delta method for a ratio of two independent means."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return r_t / r_c - 1.0, var_t / r_c**2 + r_t**2 * var_c / r_c**4


def fixed_halfwidth(var: Any, alpha: float) -> Any:
    """Half the width of the two-sided (1 - alpha) normal interval, valid at one fixed look."""
    return stats.norm.ppf(1 - alpha / 2) * np.sqrt(var)


def cs_halfwidth(var: Any, n: Any, alpha: float, tuning: float = CS_TUNING) -> Any:
    """Half the width of the two-sided (1 - alpha) asymptotic confidence sequence of Howard et
    al. (2021) / Waudby-Smith et al. (eq. 2.9 of arXiv:2103.06476), the normal mixture behind
    GrowthBook's sequential testing: it covers the true value at every n at once, so the
    experiment may be watched after every unit. `var` is the estimator's variance at n units in
    total; rho is chosen so that the sequence is tightest at n = `tuning`."""
    la = -2.0 * np.log(alpha)
    rho2 = (la + np.log(la + 1.0)) / tuning
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.asarray(n, dtype=np.float64)
        s2 = var * n  # the variance of one unit's contribution
        factor = 2.0 * (n * rho2 + 1.0) / (n * n * rho2) * np.log(np.sqrt(n * rho2 + 1.0) / alpha)
        return np.sqrt(s2 * factor)


def sample_size(unit_var_t: Any, r_t: Any, unit_var_c: Any, r_c: Any, mde: float,
                alpha: float, power: float = 0.8) -> Any:
    """Units per arm for a two-sided level-alpha test to detect a relative change of `mde` with
    the given power, at the observed means and per-unit variances (n * Var(R) of each arm)."""
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.ceil(z * z * (unit_var_t / r_c**2 + r_t**2 * unit_var_c / r_c**4) / mde**2)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, Any]:
    """p50/p90/p99 (numpy's linear interpolation) and the mean; None without values."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in qs}}
    a = np.asarray(values, dtype=np.float64)
    return {"count": int(a.size), "mean": float(a.mean()),
            **{f"p{q}": float(np.percentile(a, q)) for q in qs}}


def t_interval(values: list[float], alpha: float) -> dict[str, Any]:
    """The mean of per-slot values with its two-sided (1 - alpha) Student t interval."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"slots": 0, "mean": None, "ci": [None, None]}
    mean = float(a.mean())
    if a.size < 2:
        return {"slots": 1, "mean": mean, "ci": [None, None]}
    h = float(stats.t.ppf(1 - alpha / 2, a.size - 1) * a.std(ddof=1) / np.sqrt(a.size))
    return {"slots": int(a.size), "mean": mean, "ci": [mean - h, mean + h]}


def welch(treatment: list[float], control: list[float], alpha: float) -> dict[str, Any]:
    """Difference of means (treatment - control) over slots, with Welch's t interval and p."""
    t = np.asarray(treatment, dtype=np.float64)
    c = np.asarray(control, dtype=np.float64)
    if t.size < 2 or c.size < 2:
        return {"diff": None, "lift": None, "ci": [None, None], "p_value": None, "df": None}
    vt, vc = t.var(ddof=1) / t.size, c.var(ddof=1) / c.size
    diff = float(t.mean() - c.mean())
    se2 = vt + vc
    if se2 == 0:
        return {"diff": diff, "lift": _rel(diff, c.mean()), "ci": [diff, diff],
                "p_value": None, "df": None}
    df = se2**2 / (vt**2 / (t.size - 1) + vc**2 / (c.size - 1))
    h = float(stats.t.ppf(1 - alpha / 2, df) * np.sqrt(se2))
    p = float(2 * stats.t.sf(abs(diff) / np.sqrt(se2), df))
    return {"diff": diff, "lift": _rel(diff, c.mean()), "ci": [diff - h, diff + h],
            "p_value": p, "df": float(df)}


def _rel(diff: float, base: float) -> float | None:
    return float(diff / base) if base else None


def srm(counts: dict[str, int], weights: dict[str, float],
        threshold: float = 0.001) -> dict[str, Any]:
    """Sample-ratio mismatch: chi-square goodness of fit of the counts to the weights (equal
    weights where none are given), flagged at p < threshold. An arm of weight 0 that received
    units is a mismatch outright."""
    arms = list(counts)
    w = {a: float(weights.get(a, 0.0)) for a in arms} if weights else {a: 1.0 for a in arms}
    total_w = sum(w.values())
    total = sum(counts.values())
    out: dict[str, Any] = {"counts": dict(counts), "expected": None, "chi2": None,
                           "p_value": None, "flagged": False, "threshold": threshold}
    live = [a for a in arms if w[a] > 0]
    if total == 0 or total_w <= 0 or len(live) < 2:
        return out
    expected = {a: total * w[a] / total_w for a in arms}
    out["expected"] = expected
    if any(counts[a] > 0 for a in arms if w[a] == 0):
        out.update(p_value=0.0, flagged=True)
        return out
    obs = np.array([counts[a] for a in live], dtype=np.float64)
    exp = np.array([expected[a] for a in live])
    exp *= obs.sum() / exp.sum()  # chisquare wants equal totals to rounding
    res = stats.chisquare(obs, exp)
    out.update(chi2=float(res.statistic), p_value=float(res.pvalue),
               flagged=bool(res.pvalue < threshold))
    return out
