"""The cost model the goodput controller plans with (specdec/cost_model.py): real steps,
calibration and its cache, what a drafted step adds per drafting sequence, drafters'
costs."""

from __future__ import annotations

import json
import random
import time

import pytest

from specdec.calibration import CALIBRATION_ROWS
from specdec.cost_model import HOST_AGE, CostModel


def test_cost_model_interpolates_and_never_assumes_larger_is_cheaper():
    c = CostModel()
    assert c.pass_time(4) == 0.0
    c.record_pass(1, 1.0)
    assert c.pass_time(8) == 1.0  # one point: a larger pass is tried once at that price
    c.record_pass(4, 1.6)
    assert c.pass_time(2) == pytest.approx(1.2)
    assert c.pass_time(8) == pytest.approx(1.6 + 0.2 * 4)
    c.record_pass(4, 9.0)  # a slow step on a busy machine: the (lower) median stands
    assert c.pass_time(4) == 1.6
    c.draft.record("draft_model", 2, 4, 0.8)
    assert c.draft.time("draft_model", 2, 2) == pytest.approx(0.4)  # one depth: proportional
    c.draft.record("draft_model", 2, 1, 0.3)
    assert c.draft.time("draft_model", 2, 2) == pytest.approx(0.3 + 0.5 / 3)
    assert c.draft.time("draft_model", 3, 4) == pytest.approx(0.8)  # the nearest batch size
    assert c.draft.time("ngram", 1, 4) == 0.0


def test_host_work_per_drafting_sequence_is_learnt_apart_from_the_rows():
    c = CostModel()
    for rows in (1, 2, 4, 8, 16, 32, 64):
        c.record_pass(rows, 1.0 + 0.01 * rows)  # plain steps
    assert c.spec_time(4) == 0.0  # no drafted step yet
    rng = random.Random(0)
    for step in range(48):
        s = (2, 4, 8)[step % 3]
        rows = 8 + 4 * s
        slow = 5.0 if step % 8 == 0 else 0.0  # a step slowed by another process
        c.record_pass(rows, 1.0 + 0.01 * rows + 0.05 + 0.1 * s + slow + rng.uniform(-0.01, 0.01),
                      s)
    for s in (1, 2, 4, 8, 16):
        assert c.spec_time(s) == pytest.approx(0.05 + 0.1 * s, abs=0.02)
    assert c.spec_time(0) == 0.0
    # Plain steps' cost: drafted ones of the same rows, less their fitted extra, agree with it.
    assert c.pass_time(16) == pytest.approx(1.16, abs=0.005)

    one = CostModel()
    one.record_pass(8, 1.0)
    one.record_pass(40, 1.8, 8)  # one count measured: proportional below it, flat above
    assert one.spec_time(8) == pytest.approx(0.8)  # 1.8 less the plain step's 1.0
    assert one.spec_time(4) == pytest.approx(0.4)
    assert one.spec_time(32) == pytest.approx(0.8)
    for _ in range(HOST_AGE):
        one.record_pass(8, 1.0)
    assert one.spec_time(8) == 0.0  # forgotten: the next drafted step measures it again


def test_calibration_is_cached(tmp_path):
    calls = []
    cache = tmp_path / "pass.json"
    curve = CostModel().calibrate(lambda n: calls.append(n), 8, cache)
    assert set(curve) == {1, 2, 3, 4, 5, 6, 8} and calls and cache.is_file()
    calls.clear()
    model = CostModel()
    assert model.calibrate(lambda n: calls.append(n), 8, cache) == curve and not calls
    assert model.knows(6)


def test_calibration_stops_at_its_time_budget_and_its_cache_says_so(tmp_path, monkeypatch):
    # A slow pass (a small model on the portable kernels): the larger sizes are left to the
    # curve's slope, and the cut curve, cached, is not measured again at the next start.
    import specdec.calibration as cm

    monkeypatch.setattr(cm, "CALIBRATION_BUDGET_S", 0.05)
    calls: list[int] = []

    def slow(n: int) -> None:
        calls.append(n)
        time.sleep(0.004 * n)

    cache = tmp_path / "pass.json"
    curve = CostModel().calibrate(slow, 128, cache)
    assert 3 <= len(curve) < len(cm.CALIBRATION_ROWS) and max(curve) < 128
    calls.clear()
    model = CostModel()
    assert model.calibrate(_never, 128, cache) == curve
    assert model.pass_time(128) > model.pass_time(max(curve))  # the slope past the cut



def _cached_curve(tmp_path, name, seconds, rows=(1, 2, 3, 4, 5, 6, 8)):
    """A cache file as calibration writes it, seconds per row count (1-8 unless `rows`)."""
    cache = tmp_path / name
    cache.write_text(json.dumps({"pass_seconds": {str(r): seconds(r) for r in rows}}))
    return cache


def _never(n):
    raise AssertionError("a cached curve is not measured again")


def test_a_calibrated_draft_model_is_priced_before_it_proposes(tmp_path):
    c = CostModel()
    c.draft.calibrate("draft_model", _never, 8,
                        _cached_curve(tmp_path, "d.json", lambda r: 0.01 + 0.002 * r))
    # One pass over two tokens a sequence, then one over one token a sequence per depth.
    assert c.draft.time("draft_model", 4, 3) == pytest.approx(0.026 + 2 * 0.018)
    assert c.draft.time("ngram", 4, 3) == 0.0  # nothing calibrated, nothing measured
    # Real proposals at batch 1 cost twice the calibrated estimate: other batches scale by it.
    for _ in range(3):
        c.draft.record("draft_model", 1, 3, 2 * (0.014 + 2 * 0.012))
    assert c.draft.time("draft_model", 1, 3) == pytest.approx(2 * 0.038)
    assert c.draft.time("draft_model", 4, 3) == pytest.approx(2 * (0.026 + 2 * 0.018))


def test_real_steps_add_their_host_time_to_the_calibrated_curve(tmp_path):
    c = CostModel()
    c.calibrate(lambda n: None, 8, None)  # near-zero passes
    c.calibration = type(c.calibration)()
    for r in (1, 2, 4, 8):
        c.calibration.record(r, 0.01 * r)
    c.record_pass(1, 0.51)  # a real step: the pass and 0.5 s of host work
    assert c.pass_time(1) == pytest.approx(0.51)
    assert c.pass_time(4) == pytest.approx(0.04 + 0.5)  # calibrated, plus the host's share
    c.record_pass(4, 1.04)  # a larger real step adds more (host-drafted, say)
    assert c.pass_time(2) == pytest.approx(0.51 + (1.04 - 0.51) / 3)  # real steps between
    assert c.pass_time(8) == pytest.approx(0.08 + 1.0)  # past them: the nearest one's share


def test_a_pass_past_the_real_steps_is_never_cheaper_than_the_largest(tmp_path):
    c = CostModel()
    # A calibration that falls with rows (its shape is one segment's, not a batch's).
    c.calibrate(_never, 8, _cached_curve(tmp_path, "t.json", lambda r: 0.01 / r))
    c.record_pass(2, 0.005)
    c.record_pass(4, 0.006)
    assert c.pass_time(8) == pytest.approx(0.006)
    assert c.pass_time(1) == pytest.approx(0.005)


def test_a_calibration_spike_is_cut_to_the_cheapest_larger_size(tmp_path):
    spiky = {1: 0.03, 2: 0.031, 3: 0.033, 4: 0.035, 5: 0.036, 6: 1.75, 8: 0.04}
    c = CostModel()
    curve = c.calibrate(_never, 8, _cached_curve(tmp_path, "t.json", spiky.__getitem__))
    assert curve[6] == 0.04 and curve[5] == 0.036 and curve[8] == 0.04


def test_chained_steps_price_their_rows_in_the_batched_shape(tmp_path):
    # A calibration that jumps at 96 rows (as one segment of that many rows did, run eagerly);
    # 16 sequences drafting 8 deep, chained, cost far less than it says. Their time prices those
    # rows, interpolated down to the plain batch, and leaves them no extra; a host-planned
    # drafted step keeps its own.
    c = CostModel()
    c.calibrate(_never, 128, _cached_curve(tmp_path, "c.json",
                                           lambda r: 0.004 if r <= 64 else 0.016,
                                           CALIBRATION_ROWS))
    c.record_pass(16, 0.0046)
    assert c.pass_time(144) == pytest.approx(0.0166)  # the calibration's, offset
    c.record_pass(144, 0.0102, 16, chained=True)
    assert c.pass_time(144) == pytest.approx(0.0102)
    assert c.pass_time(80) == pytest.approx(0.0046 + 0.0056 * 64 / 128)
    assert c.spec_time(16) == pytest.approx(0.0)
    for _ in range(3):
        c.record_pass(144, 0.0192, 16)  # planned on the host: 9 ms more
    assert c.pass_time(144) == pytest.approx(0.0102)
    assert c.spec_time(16) == pytest.approx(0.009)


def test_host_planned_drafted_steps_correct_a_calibration_that_overprices_their_rows(tmp_path):
    # 96+ rows calibrated at 20 ms; 16 sequences drafting 8 deep, planned on the host, take
    # 10.5 ms in all. Priced by the calibration, drafting would never pay again.
    c = CostModel()
    c.calibrate(_never, 128, _cached_curve(tmp_path, "c.json",
                                           lambda r: 0.0046 if r <= 64 else 0.020,
                                           CALIBRATION_ROWS))
    c.record_pass(16, 0.0046)
    for _ in range(8):
        c.record_pass(144, 0.0105, 16)
    assert c.pass_time(144) + c.spec_time(16) == pytest.approx(0.0105, rel=0.02)
    assert c.pass_time(144) < 0.011
    c.forget_steps()  # a fresh start: the calibration's price again
    assert c.pass_time(144) == pytest.approx(0.020) and c.spec_time(16) == 0.0


def test_a_split_never_prices_a_drafted_pass_below_a_plain_step_of_its_batch():
    # A drafted step much cheaper than the extra so far fitted (fixed k = 2 at one count after
    # k = 8's dear host work): its rows' pass is floored at the batch's plain step, not below.
    c = CostModel()
    c.record_pass(16, 0.005, batch=16)
    for _ in range(3):
        c.record_pass(144, 0.020, 16, batch=16)  # extra 15 ms at 16 drafting
    c.record_pass(48, 0.008, 16, batch=16)  # 8 ms in all, less than that extra
    assert c.pass_time(48) >= c.pass_time(16) > 0


def test_whole_steps_by_batch_and_rows_per_sequence():
    c = CostModel()
    for rows in (4, 8):
        c.record_pass(rows, 0.001 * rows)  # plain steps: the split model's pass
    assert c.step_time(4, 3, 4) == pytest.approx(0.012)  # no step at batch 4 yet: the split's
    c.record_step(4, 1, 0.004)
    c.record_step(4, 5, 0.006)
    assert c.step_time(4, 5, 4) == 0.006  # measured
    assert c.step_time(4, 3, 4) == pytest.approx(0.005)  # between, interpolated
    # Beyond: the nearest measured moved by the split model's difference (rows 36 against 20,
    # priced on the slope of the two real plain steps), never below it.
    assert c.step_time(4, 9, 4) == pytest.approx(0.006 + 0.016)
    c.record_step(4, 5, 0.010)
    c.record_step(4, 5, 0.012)
    assert c.step_time(4, 5, 4) == 0.010  # the median of the recent ones
    c.forget_steps()
    assert c.steps == {}


def test_a_plain_step_priced_from_drafted_ones_sheds_their_host_work():
    # Only a drafted step measured at this batch (16 sequences, 8 rows each, 3.4 ms of it host
    # work for drafting): a plain step is that step less the rows' pass difference and less
    # that host work, not just less the rows (which priced a 6 ms plain step at 9.4).
    c = CostModel()
    c.calibration.record(16, 0.006)
    c.calibration.record(128, 0.008)
    c.record_pass(128, 0.0114, 16, batch=16)
    c.record_step(16, 8, 0.0114, 16)
    assert c.spec_time(16) == pytest.approx(0.0034)
    assert c.step_time(16, 1, 0) == pytest.approx(0.006)
    assert c.step_time(16, 8, 16) == pytest.approx(0.0114)


def test_a_step_priced_below_the_measured_ones_costs_at_least_its_pass():
    # Batch 64 on an H100: the calibration timed up to 128 rows and its line past them misses
    # most of a 512-row pass, so drafted steps of 2 and 4 rows a sequence are split into a
    # small pass and a large host extra; a plain step priced from them less that extra read
    # 3.7 ms against 7.6. It is never priced below its own pass (the calibrated 7.3 ms).
    c = CostModel()
    c.calibration.record(64, 0.0073)
    c.calibration.record(128, 0.0079)
    for q, sec in ((2, 0.0096), (4, 0.01346)):
        c.record_pass(64 * q, sec, 64, batch=64)
        c.record_step(64, q, sec, 64)
    assert c.step_time(64, 1, 0) == pytest.approx(0.0073)


def test_calibration_times_rows_in_a_decode_steps_shape_and_leaves_generation_alone(
        tiny_llama, tmp_path, monkeypatch):
    # Past SEGMENT_ROWS the rows are timed as a batch of sequences (one segment of 96 rows fits
    # no CUDA graph bucket); each sequence writes only blocks no request holds, and generation
    # after it is what it is without it.
    from specdec.calibration import SEGMENT_ROWS, calibrate_runner
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    p = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [[1, 5, 9, 3, 7, 5, 9, 3], [2, 4, 6]]
    ref = [o.token_ids for o in LLM(model=str(tiny_llama), speculative={"method": "none"})
           .generate(prompts, p)]
    llm = LLM(model=str(tiny_llama), speculative={"method": "none"})
    runner, steps = llm.engine.runner, []
    execute = runner.execute

    def spy(segments, *args, **kw):
        steps.append(segments)
        return execute(segments, *args, **kw)

    monkeypatch.setattr(runner, "execute", spy)
    timed = {}

    def measure(run_pass, max_rows, cache):
        for n in (1, 8, 9, max_rows):
            steps.clear()
            run_pass(n)
            timed[n] = steps[0]
        return {}

    calibrate_runner(runner, 128, measure)
    assert max(timed) > 2 * SEGMENT_ROWS
    for n, segments in timed.items():
        assert sum(len(s.tokens) for s in segments) == n
        assert all(len(s.tokens) <= SEGMENT_ROWS for s in segments)
        slots = [x for s in segments for x in s.slots]
        assert len(set(slots)) == len(slots)
        blocks = [b for s in segments for b in s.block_table]
        assert len(set(blocks)) == len(blocks)  # no two sequences share a block
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(prompts, p)] == ref


def test_a_rarely_planned_depth_is_priced_from_every_proposal_of_a_calibrated_drafter(tmp_path):
    # A draft model proposes 3 deep step after step and once, as a probe, 4 deep in a slow
    # moment. Read per depth, 4 deep would keep that one time (twice its share) and look too
    # dear to plan again; priced from the calibrated shape and all proposals, it costs one pass
    # more than 3 deep.
    c = CostModel()
    c.draft.calibrate("draft_model", _never, 8,
                        _cached_curve(tmp_path, "d.json", lambda r: 0.008 + 0.001 * r))
    for _ in range(20):
        c.draft.record("draft_model", 1, 3, 0.010 + 2 * 0.009)
    c.draft.record("draft_model", 1, 4, 2 * (0.010 + 3 * 0.009))
    assert c.draft.time("draft_model", 1, 4) == pytest.approx(0.010 + 3 * 0.009)
    assert c.draft.time("draft_model", 1, 6) == pytest.approx(0.010 + 5 * 0.009)


def test_a_drafter_that_stops_short_pays_for_the_depths_it_reaches(tmp_path):
    # A draft model whose `p_min` ends half its chains with the first token drafts two deep
    # half the time and three a quarter, and runs its second pass and its third that often: a
    # plan 3 deep is priced at the passes it runs in expectation. Proposals are recorded at the
    # depth they ran, so the speed read from them stays the machine's.
    c = CostModel()
    c.draft.calibrate("draft_model", _never, 8,
                        _cached_curve(tmp_path, "d.json", lambda r: 0.008 + 0.001 * r))
    for _ in range(10):
        c.draft.record("draft_model", 1, 1, 0.010)
        c.draft.record("draft_model", 1, 2, 0.010 + 0.009)
    assert c.draft.time("draft_model", 1, 3) == pytest.approx(0.010 + 2 * 0.009)
    assert c.draft.time("draft_model", 1, 3, [1.0, 0.5, 0.25]) == pytest.approx(
        0.010 + 0.5 * 0.009 + 0.25 * 0.009)
    assert c.draft.time("draft_model", 1, 1, [1.0]) == pytest.approx(0.010)


def test_a_plain_step_is_priced_by_chained_ones_where_some_were_measured():
    # A held plain choice chains its steps on the device: they cost less than the host-planned
    # plain steps that come between drafted ones, and a plan that priced plain by those drafted
    # where plain paid.
    c = CostModel()
    c.record_step(32, 1, 0.0084)
    c.record_step(32, 1, 0.0084)
    assert c.step_time(32, 1, 0) == pytest.approx(0.0084)
    c.record_step(32, 1, 0.0068, chained=True)
    assert c.step_time(32, 1, 0) == pytest.approx(0.0068)
    c.record_step(32, 3, 0.011, 32, chained=True)  # a chained drafted step: not plain's price
    assert c.step_time(32, 1, 0) == pytest.approx(0.0068)
    c.forget_steps()
    assert c.resting == {}
