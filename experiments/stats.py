"""An experiment's statistics, recomputed from its records: `summarize` and the confidence
sequence over time.

What is comparable depends on the design (issue 26). Arms in one engine share batch steps, so
under design "request" a request's latency depends on what the other arms drafted: acceptance
metrics (what a drafter does to its own request) are compared, latency is reported per arm but
marked not comparable. Under design "switchback" the whole server runs one arm per time slot:
the slot is the unit of randomisation, so every metric is clustered by slot, burn-in records
are left out, and latency is compared over slots (Welch t).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from experiments.estimators import (
    CS_TUNING,
    RatioSums,
    cs_halfwidth,
    fixed_halfwidth,
    lift,
    percentiles,
    ratio,
    sample_size,
    srm,
    t_interval,
    welch,
)
from experiments.record import RequestRecord

METRICS = ("acceptance_rate", "tau")
LATENCY = ("ttft_s", "tpot_s", "tokens_per_s", "throughput")
SLOT_CS_TUNING = 100.0  # switchback: the sequence is tightest at 100 slots in total


def metric_xy(r: RequestRecord, metric: str) -> tuple[float, float]:
    """A record's numerator and denominator: accepted / drafted, or emitted / steps where each
    verification step emits its accepted tokens plus one (so plain decoding has tau 1)."""
    if metric == "acceptance_rate":
        return float(r.accepted_tokens), float(r.draft_tokens)
    if metric == "tau":
        return float(r.accepted_tokens + r.steps), float(r.steps)
    raise ValueError(f"unknown metric {metric!r}: choose one of {', '.join(METRICS)}")


def tokens_per_s(r: RequestRecord) -> float | None:
    """Output tokens over the request's time from arrival to its last token."""
    if r.ttft_s is None or r.output_tokens <= 0:
        return None
    total = r.ttft_s + (r.tpot_s or 0.0) * max(r.output_tokens - 1, 0)
    return r.output_tokens / total if total > 0 else None


def slot_seconds_of(definition: dict[str, Any]) -> float | dict[int, float] | None:
    """The measured seconds per slot an experiment definition declares: `slot_seconds` (one
    length, or a {slot: seconds} map as `specdec ab run` writes) less `burn_in_seconds`."""
    raw = definition.get("slot_seconds")
    burn = float(definition.get("burn_in_seconds") or 0.0)
    if isinstance(raw, dict):
        return {int(k): float(v) - burn for k, v in raw.items()}
    return float(raw) - burn if isinstance(raw, (int, float)) else None


def _clean(v: Any) -> Any:
    """JSON-safe: numpy scalars to Python numbers, nan and inf to None."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def _units(records: list[RequestRecord], by_slot: bool) -> list[list[RequestRecord]]:
    if not by_slot:
        return [[r] for r in records]
    groups: dict[Any, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.slot if r.slot is not None else ("request", r.request_id)].append(r)
    return list(groups.values())


def _metric_sums(units: list[list[RequestRecord]], metric: str) -> RatioSums:
    xy = [[metric_xy(r, metric) for r in u] for u in units]
    x = [sum(a for a, _ in u) for u in xy]
    y = [sum(b for _, b in u) for u in xy]
    return RatioSums.of(x, y)


def _per_position(records: list[RequestRecord]) -> list[dict[str, Any]]:
    width = max((max(len(r.accepted_per_position), len(r.drafted_per_position))
                 for r in records), default=0)
    acc, drafted = [0] * width, [0] * width
    for r in records:
        for i, c in enumerate(r.accepted_per_position):
            acc[i] += c
        for i, c in enumerate(r.drafted_per_position):
            drafted[i] += c
    steps = sum(r.steps for r in records)
    known = any(r.drafted_per_position for r in records)
    # `rate`: of the drafts that reached this depth, the share accepted (needs drafted counts);
    # `per_step`: the share of verification steps that accepted at least depth + 1 tokens.
    return [{"position": i + 1, "accepted": acc[i], "drafted": drafted[i] if known else None,
             "rate": acc[i] / drafted[i] if known and drafted[i] else None,
             "per_step": acc[i] / steps if steps else None} for i in range(width)]


def _arm(records: list[RequestRecord], units: list[list[RequestRecord]],
         comparable: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(records), "units": len(units),
        "output_tokens": sum(r.output_tokens for r in records),
        "draft_tokens": sum(r.draft_tokens for r in records),
        "accepted_tokens": sum(r.accepted_tokens for r in records),
        "steps": sum(r.steps for r in records)}
    for m in METRICS:
        est, var = ratio(_metric_sums(units, m))
        out[m] = {"estimate": float(est) if np.isfinite(est) else None,
                  "se": float(np.sqrt(var)) if np.isfinite(var) else None}
    out["per_position"] = _per_position(records)
    out["latency"] = {
        "comparable": comparable,
        "ttft_s": percentiles([r.ttft_s for r in records if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in records if r.tpot_s is not None]),
        "tokens_per_s": percentiles([v for r in records if (v := tokens_per_s(r)) is not None])}
    return out


def _compare(t: list[list[RequestRecord]], c: list[list[RequestRecord]], metric: str,
             alpha: float, mde: float, tuning: float) -> dict[str, Any]:
    rt, vt = ratio(_metric_sums(t, metric))
    rc, vc = ratio(_metric_sums(c, metric))
    if not (np.isfinite(rc) and rc != 0):
        why = "the control drafts no tokens" if metric == "acceptance_rate" else "no control data"
        return {"lift": None, "reason": why}
    est, var = lift(rt, vt, rc, vc)
    n = len(t) + len(c)
    fh, sh = fixed_halfwidth(var, alpha), cs_halfwidth(var, n, alpha, tuning)
    need = sample_size(vt * len(t), rt, vc * len(c), rc, mde, alpha)
    fixed, seq = [est - fh, est + fh], [est - sh, est + sh]
    return {"treatment": rt, "control": rc, "lift": est, "se": np.sqrt(var),
            "fixed": fixed, "sequential": seq,
            "significant_fixed": bool(fixed[0] > 0 or fixed[1] < 0),
            "significant_sequential": bool(seq[0] > 0 or seq[1] < 0),
            "required_per_arm": need,
            "remaining_per_arm": max(need - min(len(t), len(c)), 0) if np.isfinite(need)
            else None}


def _slot_values(units: list[list[RequestRecord]],
                 slot_seconds: float | dict[int, float] | None) -> dict[str, list[float]]:
    """Per slot: the mean TTFT, TPOT and tokens/s of its requests, and its throughput (output
    tokens per second of measured slot time; the span of its finish times where the length is
    not known)."""
    vals: dict[str, list[float]] = {k: [] for k in LATENCY}
    for u in units:
        for key in ("ttft_s", "tpot_s"):
            xs = [getattr(r, key) for r in u if getattr(r, key) is not None]
            if xs:
                vals[key].append(float(np.mean(xs)))
        tps = [v for r in u if (v := tokens_per_s(r)) is not None]
        if tps:
            vals["tokens_per_s"].append(float(np.mean(tps)))
        slot = u[0].slot
        if isinstance(slot_seconds, dict):
            secs = slot_seconds.get(slot) if slot is not None else None
        elif slot_seconds is not None:
            secs = slot_seconds
        else:
            secs = max(r.finished_at for r in u) - min(r.finished_at for r in u)
        if secs and secs > 0:
            vals["throughput"].append(sum(r.output_tokens for r in u) / secs)
    return vals


def summarize(records: list[RequestRecord], *, control: str, arms: list[str],
              weights: dict[str, float], design: str, alpha: float = 0.05, mde: float = 0.05,
              cs_tuning: float | None = None,
              slot_seconds: float | dict[int, float] | None = None) -> dict[str, Any]:
    """The experiment's statistics as a JSON-serialisable dict (see the module docstring).

    `cs_tuning`: the total number of units at which the confidence sequence is tightest
    (default 5000 requests, GrowthBook's default, or 100 switchback slots). `slot_seconds`: the
    measured length of a slot, one for all or per slot index (switchback throughput)."""
    if design not in ("request", "switchback"):
        raise ValueError(f"design must be 'request' or 'switchback', got {design!r}")
    if control not in arms:
        raise ValueError(f"control arm {control!r} is not one of the arms {arms}")
    switchback = design == "switchback"
    tuning = cs_tuning or (SLOT_CS_TUNING if switchback else CS_TUNING)
    kept = [r for r in records if not (switchback and r.in_burn_in)]
    by_arm = {a: [r for r in kept if r.arm == a] for a in arms}
    units = {a: _units(rs, switchback) for a, rs in by_arm.items()}
    out: dict[str, Any] = {
        "design": design, "control": control, "alpha": alpha, "mde": mde,
        "unit": "slot" if switchback else "request", "cs_tuning": tuning,
        "records": len(records), "excluded_burn_in": len(records) - len(kept),
        "unknown_arm_records": sum(r.arm not in by_arm for r in kept),
        "arms": {a: _arm(by_arm[a], units[a], switchback) for a in arms},
        "comparisons": {},
        "srm": srm({a: len(units[a]) for a in arms}, weights)}
    slots = {a: _slot_values(units[a], slot_seconds) for a in arms} if switchback else {}
    for a in arms:
        if switchback:
            out["arms"][a]["slots"] = {k: t_interval(v, alpha) for k, v in slots[a].items()}
        if a == control:
            continue
        cmp = {m: _compare(units[a], units[control], m, alpha, mde, tuning) for m in METRICS}
        if switchback:
            cmp["latency"] = {k: welch(slots[a][k], slots[control][k], alpha) for k in LATENCY}
        out["comparisons"][a] = cmp
    return _clean(out)


def confidence_sequence_history(records: list[RequestRecord], control: str, arm: str,
                                metric: str, alpha: float = 0.05, *,
                                cs_tuning: float = CS_TUNING,
                                max_points: int = 200) -> list[dict[str, Any]]:
    """The lift of `arm` over `control` after each record in finished_at order (at most
    `max_points` evenly spaced looks), with the fixed-horizon interval and the confidence
    sequence at that look. Units are requests; burn-in records are left out."""
    rs = sorted((r for r in records if r.arm in (arm, control) and not r.in_burn_in),
                key=lambda r: r.finished_at)
    if not rs:
        return []
    xy = np.array([metric_xy(r, metric) for r in rs])  # [records, 2]
    is_t = np.array([r.arm == arm for r in rs])
    t = RatioSums.of(xy[:, 0], xy[:, 1], is_t, cumulative=True)
    c = RatioSums.of(xy[:, 0], xy[:, 1], ~is_t, cumulative=True)
    (rt, vt), (rc, vc) = ratio(t), ratio(c)
    est, var = lift(rt, vt, rc, vc)
    n = np.arange(1, len(rs) + 1)
    fh, sh = fixed_halfwidth(var, alpha), cs_halfwidth(var, n, alpha, cs_tuning)
    ok = np.flatnonzero(np.isfinite(est) & np.isfinite(var))
    if ok.size == 0:
        return []
    looks = np.unique(np.linspace(ok[0], len(rs) - 1, min(max_points, len(rs) - ok[0]))
                      .round().astype(int))
    return _clean([{"n": int(i + 1), "finished_at": rs[i].finished_at, "lift": est[i],
                    "fixed": [est[i] - fh[i], est[i] + fh[i]],
                    "sequential": [est[i] - sh[i], est[i] + sh[i]]} for i in looks])
