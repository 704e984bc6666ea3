"""The goodput controller for a runner that pads every sequence of a step to the deepest one's
rows (CUDA graph buckets): one depth for the batch, priced by whole steps, with made-up costs
(no model, no timing). The controller in general: tests/test_spec_control.py."""

from __future__ import annotations

import random

import pytest
from test_cost_model import _cached_curve, _never

from specdec.calibration import CALIBRATION_ROWS
from specdec.depth_plan import Alternative, Candidate, uniform_depths
from specdec.spec_control import PROBE_EVERY, PROBE_MAX, SpeculationController, geometric


def test_a_padding_runner_gets_one_depth_for_the_batch_and_probes_it_whole():
    # Rows nearly free (a GPU), sequences of different acceptance: best_depths would give them
    # different depths, which a runner that pads to the deepest pays in full.
    alts = [Alternative("ngram", 6, 1, geometric(a, 6)) for a in (0.9, 0.6, 0.3)]

    def pass_time(rows):
        return 1.0 + 0.08 * rows

    def step_time(q, drafting):  # three sequences of q rows each
        return pass_time(3 * q)

    ks, rate = uniform_depths(alts, 1, 0, step_time, lambda m, n, d: 0.0, 0.0, 0.05)
    assert len(set(ks)) == 1 and 0 < ks[0] < 6

    def rate_at(k):  # what the batch emits per second at one depth for all
        return (3 + sum(sum(a.survival[:k]) for a in alts)) / pass_time(3 + 3 * k)

    assert rate == pytest.approx(max(rate_at(k) for k in range(7)))
    assert ks[0] == max(range(7), key=rate_at)
    assert uniform_depths(alts, 1, 0, lambda q, s: 3.0 * q, lambda m, n, d: 0.0,
                          0.0, 0.05)[0] == [0, 0, 0]  # every row a pass: plain

    c = SpeculationController()
    c.uniform = True
    for q in (1, 2, 4, 7):
        c.record_pass(3 * q, pass_time(3 * q), 3 if q > 1 else 0, False, 3, q)
    cands = [Candidate(str(i), [a]) for i, a in enumerate(alts)]
    depths = [[ch.k for ch in c.choose(3, 0, cands).values()] for _ in range(PROBE_EVERY)]
    assert all(d == depths[0] and len(set(d)) == 1 for d in depths[:-1])
    assert depths[-1] == [depths[0][0] + 1] * 3  # the probe: the whole batch one deeper


def bucket(batch, rows_per_seq):
    """The graph runner's bucket (specdec/step_inputs.py; imported first, that module's import
    of the drafters would be circular)."""
    from specdec.step_inputs import bucket as of

    return of(batch, rows_per_seq)


def _padded_run(c, ids, steps, surv, cost, rng):
    """`steps` steps of a uniform controller over `ids`, acceptance drawn from `surv`, each
    step's seconds `cost(q)` at q rows per sequence: the depth each step had."""
    chosen = []
    for _ in range(steps):
        cands = [Candidate(r, [Alternative("m", len(surv), 1, c.survival(r, "m", len(surv)))])
                 for r in ids]
        k = max(ch.k for ch in c.choose(len(ids), 0, cands, len(ids)).values())
        for r in ids:
            acc = 0
            while acc < k and rng.random() < surv[acc] / (surv[acc - 1] if acc else 1.0):
                acc += 1
            c.verified(r, "m", k, acc, acc + 1)
        c.record_pass(len(ids) * (k + 1), cost(k + 1), len(ids) if k else 0, False, len(ids),
                      k + 1)
        chosen.append(k)
    return chosen


def test_a_padding_runner_finds_the_best_depth_from_whole_steps_and_probes_less_when_it_stands():
    # A simulated GPU at batch 16: a drafted step pays 3 ms of host work that a plain one
    # does not, and rows grow dearer with depth; the controller knows only the plain step.
    batch, rng = 16, random.Random(3)
    surv = [0.8, 0.65, 0.5, 0.3, 0.2, 0.12, 0.08, 0.05]

    def cost(q):
        return 0.005 + (0.003 if q > 1 else 0.0) + 0.00004 * batch * (q - 1) ** 1.5

    def rate(k):
        return batch * (1 + sum(surv[:k])) / cost(k + 1)

    best = max(range(len(surv) + 1), key=rate)
    assert 0 < best < len(surv)
    c = SpeculationController()
    c.uniform = True
    c.record_pass(batch, cost(1), 0, False, batch, 1)
    ids = [f"r{i}" for i in range(batch)]
    chosen = _padded_run(c, ids, 600, surv, cost, rng)
    late = chosen[-300:]
    held = max(set(late), key=late.count)
    assert rate(held) >= 0.97 * rate(best)
    assert sum(rate(k) for k in late) >= 0.97 * rate(best) * len(late)
    # Off the held depth: probes (one deeper), which come less often once the same choice
    # keeps standing, and the choice following acceptance's noise now and then.
    assert 0 < sum(1 for k in late if k != held) < 0.1 * len(late)
    assert c.probe_period == PROBE_MAX
    # A request that arrives is probed within PROBE_EVERY steps.
    ids[0] = "new"
    after = _padded_run(c, ids, PROBE_EVERY + 1, surv, cost, rng)
    assert any(k != held for k in after)


def test_a_padding_runner_keeps_a_drafter_that_cannot_pay_off_and_probes_it_rarely():
    # Batch 32, an n-gram-like drafter (27% first-position survival), a drafted step 3 ms
    # dearer than a chained plain one of 5.7 ms: plain decoding, but for probes that back off.
    batch, rng = 32, random.Random(5)
    surv = [0.27, 0.15, 0.12, 0.09]

    def cost(q):
        return 0.0057 + (0.003 if q > 1 else 0.0) + 0.00001 * batch * (q - 1)

    c = SpeculationController()
    c.uniform = True
    c.record_pass(batch, cost(1), 0, False, batch, 1)
    chosen = _padded_run(c, [f"r{i}" for i in range(batch)], 800, surv, cost, rng)
    late = chosen[-400:]
    assert late.count(0) >= len(late) - 400 // (2 * PROBE_EVERY)
    assert any(late)  # ... still measured now and then


def test_a_fresh_padding_runner_goes_deeper_one_measured_step_at_a_time():
    # Only a plain step measured and the prior's optimism: the plan would take the whole
    # batch 8 deep at once. It goes one row deeper than any whole step measured near this
    # batch size, asking again each step (no holding) while that limit binds.
    batch, rng = 64, random.Random(7)
    surv = [0.28, 0.14, 0.10, 0.07, 0.05, 0.04, 0.03, 0.02]

    def cost(q):  # a drafted step dear at this batch
        return 0.0076 + (0.01 if q > 1 else 0.0) + 0.0003 * batch * (q - 1)

    c = SpeculationController()
    c.uniform = True
    c.record_pass(batch, cost(1), 0, False, batch, 1)
    assert c.costs.deepest_step(batch) == 1 and c.costs.deepest_step(3) == 1
    ids = [f"r{i}" for i in range(batch)]
    first = _padded_run(c, ids, 4, surv, cost, rng)
    assert first[0] <= 1 and all(b <= a + 1 for a, b in zip(first, first[1:]))
    assert c.costs.deepest_step(batch) <= 3
    late = _padded_run(c, ids, 200, surv, cost, rng)[-100:]
    assert late.count(0) >= 95  # off, but for a probe

    # Where drafting pays, the depth still climbs to what pays, a row a step.
    rich = [0.9] * 8
    c = SpeculationController()
    c.uniform = True
    c.record_pass(4, 0.005, 0, False, 4, 1)
    climb = _padded_run(c, [f"s{i}" for i in range(4)], 12, rich,
                        lambda q: 0.005 + 0.0001 * q, rng)
    assert all(a <= b <= a + 1 for a, b in zip(climb, climb[1:])) and climb[-1] == 8

    # Batch 1 on a GPU, a lookup drafter: its first position alone does not pay for a drafted
    # step's host work, its eight together do. The limit slows the climb, not the plan.
    lookup = [0.28, 0.16, 0.12, 0.1, 0.09, 0.08, 0.07, 0.06]

    def gpu_b1(q):
        return 0.0055 + (0.003 if q > 1 else 0.0) + 0.00002 * (q - 1)

    c = SpeculationController()
    c.uniform = True
    c.record_pass(1, gpu_b1(1), 0, False, 1, 1)
    climb = _padded_run(c, ["t"], 80, lookup, gpu_b1, random.Random(7))
    # Never more than one deeper than the deepest step so far.
    assert climb.count(8) >= 20
    assert all(k <= max(climb[:i], default=0) + 1 for i, k in enumerate(climb))


def test_a_calibrated_padding_runner_goes_as_deep_at_once_as_the_calibration_timed(tmp_path):
    # The calibration timed up to 128 rows in a decode step's shape: at batch 1 the plan may
    # go 8 deep at its first drafted step; at batch 16, 7 deep (8 rows a sequence); at batch
    # 64, only one row past what real steps measured, as without a calibration.
    def cost(q):
        return 0.0055 + 0.00002 * q

    c = SpeculationController()
    c.uniform = True
    c.costs.calibrate(_never, 128, _cached_curve(tmp_path, "t.json", cost, CALIBRATION_ROWS))
    assert [c.costs.deepest_step(b) for b in (1, 4, 16, 32, 64, 128)] == [127, 31, 7, 3, 1, 1]
    c.record_pass(1, cost(1), 0, False, 1, 1)
    climb = _padded_run(c, ["t"], 6, [0.9] * 8, cost, random.Random(1))
    assert climb[0] == 8  # no climb a row a step


@pytest.mark.parametrize("pad", [True, False])
def test_a_padding_runner_prices_steps_by_their_bucket_and_holds_no_unmeasured_one(pad):
    # Batch 64 on CUDA graph buckets of 1, 2, 4, 8, 16 rows a sequence: 8 deep (9 rows) runs in
    # the 16-row bucket, far dearer than 7 deep (8 rows), the best. Priced by its own rows,
    # 9 looks one row dearer than a measured 8.
    batch, rng = 64, random.Random(11)
    surv = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55]

    def cost(q):
        rows = bucket(batch, q)[1]
        return 0.0075 + (0.004 if rows > 1 else 0.0) + 0.0008 * (rows - 1)

    def rate(k):
        return (1 + sum(surv[:k])) / cost(k + 1)

    assert max(range(9), key=rate) == 7 and rate(8) < 0.85 * rate(7)
    c = SpeculationController()
    c.uniform = True
    if pad:
        c.costs.pad = bucket
    c.record_pass(batch, cost(1), 0, False, batch, 1)
    chosen = _padded_run(c, [f"r{i}" for i in range(batch)], 300, surv, cost, rng)
    if pad:
        assert c.costs.knows_step(batch, 3) == (4 in c.costs.steps[batch].best)
        # 8 deep only where a step tried it: once, unmeasured, then in probes
        assert chosen.count(8) <= 1 + 300 // PROBE_EVERY
        assert max(set(chosen[-200:]), key=chosen[-200:].count) == 7
    # (without the buckets a step of 9 rows measures as 9: the plan learns it too, later)
    assert sum(rate(k) for k in chosen[-200:]) >= 0.9 * rate(7) * 200


def test_a_calibrated_padding_runner_that_starts_deep_still_learns_what_a_plain_step_costs(
        tmp_path):
    # Batch 16, the calibration timed up to 128 rows, so the first drafted step may go 7 deep
    # at once and the plain step is never measured at this batch: priced from the drafted
    # steps less their rows' pass and their host work (3.4 ms), it costs what it does, and an
    # n-gram-like drafter whose tokens do not pay for that host work is kept plain.
    batch, rng = 16, random.Random(13)
    surv = [0.28, 0.15, 0.11, 0.09, 0.07, 0.06, 0.05, 0.04]

    def pass_time(rows):
        return 0.006 + 0.000016 * (rows - batch)

    def cost(q):
        rows = batch * bucket(batch, q)[1]
        return pass_time(rows) + (0.0034 if q > 1 else 0.0)

    assert max(range(9), key=lambda k: (1 + sum(surv[:k])) / cost(k + 1)) == 0
    c = SpeculationController()
    c.pads_to(bucket)
    c.costs.calibrate(_never, 128, _cached_curve(tmp_path, "t.json", pass_time, CALIBRATION_ROWS))
    chosen = _padded_run(c, [f"r{i}" for i in range(batch)], 200, surv, cost, rng)
    assert chosen[0] >= 6  # as deep as the calibration allows, on the prior's word
    assert c.costs.step_time(batch, 1, 0) == pytest.approx(cost(1), rel=0.05)
    assert chosen[-150:].count(0) >= 150 - 150 // PROBE_EVERY - 1


def test_a_padding_runner_holds_plain_only_once_a_plain_step_is_measured(tmp_path):
    # The calibration timed a 128-row pass, but not a plain step's host work: a plain choice
    # priced by it is not held (at batch 128 on an H100, 7.9 ms calibrated against 9.6 a step,
    # and a batch held plain for a probe period where 3 deep paid), until one is measured.
    c = SpeculationController()
    c.pads_to(bucket)
    c.costs.calibrate(_never, 128, _cached_curve(tmp_path, "t.json", lambda r: 0.004 + 3e-5 * r,
                                                 CALIBRATION_ROWS))
    cands = [Candidate(f"r{i}", [Alternative("m", 8, 1, [0.02] * 8)]) for i in range(128)]
    assert not c.costs.knows_step(128, 1) and c.costs.knows_step(1, 4)
    assert all(ch.k == 0 for ch in c.choose(128, 0, cands, 128).values())
    assert not c.holding
    c.record_pass(128, 0.0096, 0, True, 128, 1)
    assert all(ch.k == 0 for ch in c.choose(128, 0, cands, 128).values())
    assert c.holding
