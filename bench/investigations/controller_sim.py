"""The goodput controller against a GPU sweep's own measured step costs, on this CPU, without an
engine: what it chooses, cell by cell, where the sweep's fixed-k and off runs say what each
choice costs, and what rate those choices would have given.

For each cell of a bench/gpu_goodput.py JSON (batch, dataset, drafter), a step's seconds by the
CUDA graph bucket that runs it (rows a sequence padded to 1, 2, 4, 8, 16) come from that cell's
runs: a plain step from off (batch / its tokens per second: chained, as the controller's held
plain steps are), a drafted step of 4, 8 and 16 rows from fixed k = 2, 4 and 8 (tau x batch /
tokens per second: a whole host-planned step, the replay drafter's proposals in it), a 2-row
step on the line through 4 and 8 (never below plain). Each run of the simulation starts as the
sweep's `--fresh-costs` runs do (the calibration alone, no evidence); every sequence accepts
each draft by the cell's survival profile (beyond its last position at its last conditional
rate, as drafters/replay.py replays it); a choice held between probes is taken without asking
the controller, as the engine's `Drafting._hold` does. The rate it reports is the batch's tokens
(every sequence decoding throughout, `--tokens` a sequence on average) over the summed step
costs, against off's and the best fixed k's from the same costs (and
the profile's expected tokens a step), so a cell's shortfall here is the controller's choosing
alone, not the GPU's noise or the engine's host work.

    PYTHONPATH=. python3 bench/investigations/controller_sim.py \\
        bench/results/gpu_goodput_h100_20261207_s32_a.json [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import specdec.engine  # noqa: F401  (imports step_inputs in an order that resolves)
from specdec.depth_plan import Alternative, Candidate
from specdec.spec_control import SpeculationController
from specdec.step_inputs import bucket


def bucket_costs(row: dict) -> dict[int, float]:
    """Seconds of a whole step by rows a sequence (1, 2, 4, 8, 16) in one sweep cell."""
    n, tok, tau = row["batch"], row["tok_s"], row["tau"]
    out = {1: n / tok["off"]}
    for k in (2, 4, 8):
        if f"k={k}" in tok:
            out[bucket(n, k + 1)[1]] = tau[f"k={k}"] * n / tok[f"k={k}"]
    if 4 in out and 8 in out:
        out[2] = max(out[1], out[4] - (out[8] - out[4]) / 2)
    return out


def survival_at(profile: list[float], k: int) -> list[float]:
    """S_1 .. S_k of a profile, past its end at its last conditional rate."""
    s = list(profile[:k])
    last = profile[-1] / profile[-2] if len(profile) > 1 and profile[-2] > 0 else profile[-1]
    while len(s) < k:
        s.append(s[-1] * last)
    return s


def simulate(row: dict, calibration: dict[int, float], tokens: int, k_max: int,
             rng: random.Random) -> dict:
    """One controller run over the cell: its rate and the depths it chose (sequence-steps)."""
    n = row["batch"]
    costs = bucket_costs(row)
    surv = survival_at([float(x) for x in row["survival"].split(",")], k_max)
    cond = [surv[0]] + [b / a if a > 0 else 0.0 for a, b in zip(surv, surv[1:])]
    c = SpeculationController()
    c.pads_to(bucket)
    for rows, sec in calibration.items():
        c.costs.calibration.record(rows, sec)
    ids = [f"s{i}" for i in range(n)]
    made = {r: 0 for r in ids}
    seconds, depths, ks = 0.0, {}, {}
    while sum(made.values()) < n * tokens:  # `tokens` a sequence on average, none leaving
        if not (ks and c.holding and c.hold_step()):  # else the last choice, held
            cands = [Candidate(r, [Alternative("replay", k_max, 1,
                                               c.survival(r, "replay", k_max))]) for r in ids]
            ks = {r: ch.k for r, ch in c.choose(n, 0, cands, n).items()}
        q = 1 + max(ks.values())
        rows = bucket(n, q)[1]
        sec = costs.get(rows) or costs[max(costs)] * rows / max(costs)
        drafting = sum(1 for k in ks.values() if k)
        for r, k in ks.items():
            acc = 0
            while acc < k and rng.random() < cond[acc]:
                acc += 1
            made[r] += acc + 1
            depths[k] = depths.get(k, 0) + 1
            if k:
                c.verified(r, "replay", k, acc, acc + 1)
        c.record_pass(n * q, sec, drafting, drafting == 0 and c.holding, n, q)
        seconds += sec
    rate = sum(made.values()) / seconds
    return {"tok_s": round(rate, 1), "depths": {str(d): depths[d] for d in sorted(depths)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", help="a bench/gpu_goodput.py JSON")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sweep = json.loads(Path(a.sweep).read_text())
    calibration = {int(r): ms / 1e3 for r, ms in sweep["pass_curve_ms"].items()}
    cells = []
    for row in sweep["rows"]:
        # each cell its own draws, so that a change in one does not reshuffle the next
        rng = random.Random(f"{row['batch']} {row['dataset']} {row['drafter']}")
        runs = [simulate(row, calibration, a.tokens, a.k_max, rng) for _ in range(a.runs)]
        # Off and each fixed k from the same costs and the profile's expected tokens a step
        # (the sweep's own runs drew their acceptance alike in every cell, which at batch 1-4
        # leaves its fixed-k taus off the profile's by up to 12%).
        n, costs = row["batch"], bucket_costs(row)
        surv = survival_at([float(x) for x in row["survival"].split(",")], a.k_max)
        fixed = {f"k={k}": n * (1 + sum(surv[:k])) / costs[bucket(n, k + 1)[1]]
                 for k in (2, 4, 8) if bucket(n, k + 1)[1] in costs}
        off = n / costs[1]
        # the best one depth for the batch, known in advance (k = 3 and 7 fill the 4- and 8-row
        # buckets that fixed k = 2 and 4 pad to)
        oracle = max((n * (1 + sum(surv[:k])) / costs[bucket(n, k + 1)[1]], k)
                     for k in range(a.k_max + 1) if bucket(n, k + 1)[1] in costs)
        mean = sum(r["tok_s"] for r in runs) / len(runs)
        cell = {"batch": n, "dataset": row["dataset"], "drafter": row["drafter"],
                "vs_off": round(mean / off, 3),
                "vs_best_fixed": round(mean / max(fixed.values()), 3),
                "best_fixed": max(fixed, key=fixed.get),
                "vs_best_depth": round(mean / oracle[0], 3), "best_depth": oracle[1],
                "sweep_controller_vs_off": row["vs_off"].get("controller"),
                "runs": runs}
        cells.append(cell)
        print(json.dumps({k: v for k, v in cell.items() if k != "runs"}
                         | {"depths": runs[0]["depths"]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"sweep": a.sweep, "runs": a.runs,
                                           "tokens": a.tokens, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
