"""Chained speculative steps (specdec/chaining.py) give the outputs of plain greedy decoding,
and their on-device step inputs are the ones the host would have packed.

On the CPU each chained step is built from host lists (the "device" is the host), so the
engine tests check the bookkeeping: KV commits a step behind, blocks reserved two steps ahead,
work past a stop dropped, a shrinking batch carried on, arrivals ending the chain. The in-place
fix of a graph step's staged inputs (`step_inputs.advance_staged`) is checked here against
`pack_step` of the steps the host would have built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import PROMPTS

from drafters import replay
from drafters.tree import row_shape
from specdec import LLM, SamplingParams
from specdec.device_drafts import TableDrafts
from specdec.step_inputs import Layout, Segment, advance_staged, pack_step
from specdec.verdict import TreeShape, accept_greedy

PROMPTS = PROMPTS[:4]


def llm(model, overlap: bool, **kw) -> LLM:
    # spec_overlap follows overlap by default
    return LLM(model=str(model), speculative={"method": "none"}, overlap=overlap, block_size=4,
               **kw)


def summary(outs):
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    outs = llm(tiny_llama, False).generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True))
    replay.clear_recorded()
    for p, o in zip(PROMPTS, outs):
        replay.record(p, o.token_ids)
    return outs


def spec_params(rate: float, k: int = 3, branches: int = 1, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, speculative={
        "method": "replay", "num_speculative_tokens": k, "corrupt_rate": rate,
        "branches": branches}, **kw)


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("rate", [0.0, 0.4, 1.0])
def test_overlapped_steps_equal_plain(tiny_llama, plain, rate, branches):
    lm = llm(tiny_llama, True)
    outs = lm.generate(PROMPTS, spec_params(rate, branches=branches, max_tokens=48))
    assert summary(outs) == summary(plain)
    eng = lm.engine
    assert eng.chainer.chained_steps >= 8
    assert eng.in_flight is None and eng.blocks.num_used == 0
    spec = eng.spec_totals["replay"]
    if rate == 0.0:  # drafts on the script are all accepted (past its end they are random)
        assert spec.emitted_tokens / spec.steps > 3.4
    if rate == 1.0:
        assert spec.accepted_tokens == 0


def test_tau_of_overlapped_steps_follows_the_rate(tiny_llama, plain):
    """The position table draws each position once, in advance: tau is the same in
    distribution as with draws at each step (drafters/replay.py)."""
    k, rate = 4, 0.3
    prompts = PROMPTS * 6
    taus = {}
    for branches in (1, 2):
        for overlap in (True, False):
            lm = llm(tiny_llama, overlap)
            outs = lm.generate(prompts, spec_params(rate, k=k, branches=branches,
                                                    max_tokens=48))
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain] * 6
            assert (lm.engine.chainer.chained_steps > 0) == overlap
            s = lm.engine.spec_totals["replay"]
            taus[branches, overlap] = s.emitted_tokens / s.steps
    assert abs(taus[1, True] - replay.expected_tau(rate, k)) < 0.45, taus
    for branches in (1, 2):  # the same tau drafted at each step on the host
        assert abs(taus[branches, True] - taus[branches, False]) < 0.45, taus
    assert taus[2, True] > taus[1, True] + 0.2, taus  # second guesses add to it


def test_stops_lengths_and_arrivals(tiny_llama, plain):
    """Requests ending at different steps (the batch shrinks under the pipeline), a stop token,
    and an arrival and an abort mid-run (they drain it)."""
    ref = plain
    params = [spec_params(0.2, max_tokens=24, stop_token_ids=[ref[0].token_ids[9]]),
              spec_params(0.2, max_tokens=5),
              spec_params(0.2, max_tokens=17),
              spec_params(0.2, max_tokens=40)]
    want = summary(llm(tiny_llama, False).generate(PROMPTS, params))
    lm = llm(tiny_llama, True)
    assert summary(lm.generate(PROMPTS, params)) == want
    assert lm.engine.chainer.chained_steps > 0 and lm.engine.blocks.num_used == 0

    eng = lm.engine
    done = {}
    for step in range(300):
        if step in (0, 4, 9):
            i = (0, 4, 9).index(step)
            eng.add_request(f"a{i}", PROMPTS[i], spec_params(0.2, max_tokens=40))
        if step == 6:
            eng.abort_request("a0")
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if step > 9 and not eng.has_unfinished():
            break
    assert done["a0"].finish_reason == "abort"
    assert done["a1"].token_ids == ref[1].token_ids[:40]
    assert done["a2"].token_ids == ref[2].token_ids[:40]
    assert eng.blocks.num_used == 0 and all(r == 0 for r in eng.blocks.ref_counts)


def test_off_when_asked(tiny_llama, plain):
    lm = LLM(model=str(tiny_llama), speculative={"method": "none"}, overlap=True,
             spec_overlap=False, block_size=4)
    outs = lm.generate(PROMPTS, spec_params(0.2, max_tokens=20))
    assert [o.token_ids for o in outs] == [o.token_ids[:20] for o in plain]
    assert lm.engine.chainer.chained_steps == 0


def test_not_taken_for_sampling_or_host_drafters(tiny_llama, plain):
    lm = llm(tiny_llama, True)
    ngram = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative={
        "method": "ngram", "num_speculative_tokens": 3})
    outs = lm.generate(PROMPTS, ngram)
    assert [o.token_ids for o in outs] == [o.token_ids[:20] for o in plain]
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True,
                             speculative={"method": "replay", "num_speculative_tokens": 3})
    lm.generate(PROMPTS[:1], sampled)
    assert lm.engine.chainer.chained_steps == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="overlapped steps on a GPU")
@pytest.mark.parametrize("method,branches", [("replay", 1), ("replay", 2), ("ngram", 1)])
def test_overlapped_steps_on_cuda_equal_plain(tiny_llama, plain, method, branches, runtime):
    """The device path itself: graph replays with their inputs moved on in place, acceptance
    and KV compaction on the device, the host reading step n back while step n+1 runs."""
    def cuda_llm() -> LLM:
        return LLM(model=str(tiny_llama), speculative={"method": "none"}, device="cuda",
                   num_blocks=256, runtime=runtime)

    plain_outs = cuda_llm().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48,
                                                             ignore_eos=True))
    try:
        replay.clear_recorded()  # the script of this device's plain run
        for p, o in zip(PROMPTS, plain_outs):
            replay.record(p, o.token_ids)
        lm = cuda_llm()
        assert lm.engine.runner.graphs is not None and lm.engine.chainer.speculative
        params = spec_params(0.4, branches=branches, max_tokens=48)
        if method == "ngram":  # prompt lookup drafted on the device (specdec/device_drafts.py)
            params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=48, speculative={
                "method": "ngram", "num_speculative_tokens": 4, "on_device": True})
        outs = lm.generate(PROMPTS, params)
        assert summary(outs) == summary(plain_outs)
        assert lm.engine.chainer.chained_steps >= 8
        assert lm.engine.in_flight is None and lm.engine.blocks.num_used == 0
    finally:  # the CPU script back, for the module's other tests
        replay.clear_recorded()
        for p, o in zip(PROMPTS, plain):
            replay.record(p, o.token_ids)


def test_accept_greedy():
    v = 10
    # Two chains of k = 3: the first accepts two drafts, the second none.
    ids = torch.tensor([[1, 4, 5, 6], [2, 7, 7, 7]])
    am = torch.tensor([[4, 5, 9, 3], [8, 7, 7, 7]])
    logits = torch.nn.functional.one_hot(am.flatten(), v).float()
    got, num, nodes = accept_greedy(logits, ids, TreeShape([-1, 0, 1]))
    assert num.tolist() == [3, 1] and nodes.tolist() == [[0, 1, -1], [-1, -1, -1]]
    assert got[0, :3].tolist() == [4, 5, 9] and got[1, 0] == 8
    # Trees of two levels of two (the chain node first): node 1, the root's second child, is
    # accepted, and it has no children (a leaf); then node 0, then its child 3.
    shape = TreeShape([-1, -1, 0, 0])
    ids = torch.tensor([[1, 4, 5, 6, 7], [1, 4, 5, 6, 7]])
    am = torch.tensor([[5, 0, 0, 0, 0], [4, 7, 0, 0, 2]])
    logits = torch.nn.functional.one_hot(am.flatten(), v).float()
    got, num, nodes = accept_greedy(logits, ids, shape)
    assert nodes.tolist() == [[1, -1], [0, 3]] and num.tolist() == [2, 3]
    assert got[0, :2].tolist() == [5, 0] and got[1].tolist() == [4, 7, 2]


@pytest.mark.parametrize("q,parents", [(4, [-1, 0, 1]), (8, [-1, 0, 1]),
                                       (8, [-1, -1, 0, 0, 2, 2])])
def test_advanced_inputs_match_the_host_packing(q, parents):
    """Staged from stale contexts, then moved on by the emitted counts on the "device": the
    buffers equal pack_step's of the segments the host would build after reading back."""
    g = torch.Generator().manual_seed(0)
    shape = TreeShape(parents)
    bs, n, b, w = 4, 3, 4, 8
    m, k = shape.rows, shape.k
    lay = Layout(b, q, w)
    tables = [torch.randperm(64, generator=g)[:w].tolist() for _ in range(n)]
    ctx = [5, 11, 2]
    table = torch.randint(0, 100, (n, 64, shape.width), generator=g)
    emitted = torch.randint(0, 100, (n + 1, k + 1), generator=g)
    num = torch.tensor([2, 3, 1, 3])
    rows = torch.tensor([0, 1, 3])  # the in-flight step's row 2 finished
    rs = row_shape(parents)

    def segs(contexts, tokens, staged):
        return [Segment(t, [c + x for x in rs.offsets],
                        [-1] * m if staged else
                        [tab[p // bs] * bs + p % bs for p in range(c, c + m)],
                        c, tab, mask=rs.mask, logits_rows=rs.logits_rows)
                for c, t, tab in zip(contexts, tokens, tables)]

    def packed(segments):
        h64, h32 = np.zeros(lay.n64, np.int64), np.zeros(lay.n32, np.int32)
        hmask = np.zeros(max(1, lay.nmask), bool)
        pack_step(segments, lay, h64, h32, hmask)
        return torch.from_numpy(h64), torch.from_numpy(h32)

    d64, d32 = packed(segs(ctx, [[0] * m] * n, True))
    ids, slots = advance_staged(d64, d32, lay, bs, n, shape, emitted, num, rows,
                                TableDrafts(table))
    new_ctx = [c + int(num[r]) for c, r in zip(ctx, rows.tolist())]
    want_tokens = [[int(emitted[r, num[r] - 1])] + [
        int(table[i, c + rs.offsets[1 + j], shape.column[j]]) for j in range(m - 1)]
        for i, (c, r) in enumerate(zip(new_ctx, rows.tolist()))]
    want = segs(new_ctx, want_tokens, False)
    w64, w32 = packed(want)
    assert ids.tolist() == want_tokens and slots.tolist() == [x.slots for x in want]
    assert torch.equal(d64, w64) and torch.equal(d32, w32)


def test_adaptive_requests_chain_drafted_steps_while_the_controller_holds(tiny_llama, plain,
                                                                          monkeypatch):
    """Rows made free: the controller gives every sequence the same depth, and the steps of
    that choice chain until the next probe, which is planned on the host; outputs are plain
    decoding's."""
    from specdec import spec_control
    from specdec.cost_model import CostModel

    monkeypatch.setattr(CostModel, "pass_time", lambda self, rows: 1.0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=48, speculative={
        "method": "replay", "num_speculative_tokens": 3, "corrupt_rate": 0.0,
        "adaptive": True})

    def run() -> tuple[int, dict]:
        lm = llm(tiny_llama, True)
        outs = lm.generate(PROMPTS, params)
        assert summary(outs) == summary(plain)
        assert lm.engine.in_flight is None and lm.engine.blocks.num_used == 0
        stats = lm.engine.drafting.controller.stats["replay"].to_dict()
        return lm.engine.chainer.chained_steps, stats["depth_histogram"]

    chained, depths = run()
    assert chained >= 6 and max(depths, key=depths.get) == "3"  # drafted 3 deep, chained
    monkeypatch.setattr(spec_control, "PROBE_EVERY", 3)
    few, _ = run()
    assert 0 < few < chained  # a host-planned step at every probe


@pytest.mark.parametrize("uniform", [False, True])
def test_a_held_choice_is_not_asked_again_between_probes(tiny_llama, plain, monkeypatch,
                                                         uniform):
    """On a runner that pads (`uniform`) the controller holds one depth for the batch until its
    next probe, and host-built steps in between take it without a choice (Drafting._hold),
    as chained steps do; elsewhere every step is chosen. Outputs are plain decoding's."""
    from specdec import spec_control
    from specdec.cost_model import CostModel

    monkeypatch.setattr(CostModel, "pass_time", lambda self, rows: 1.0)
    monkeypatch.setattr(spec_control, "PROBE_EVERY", 4)
    lm = llm(tiny_llama, False)
    eng = lm.engine
    ctl, drafting = eng.drafting.controller, eng.drafting
    ctl.uniform = uniform
    chosen, steps = [], []
    choose, depths = ctl.choose, drafting.depths
    monkeypatch.setattr(ctl, "choose", lambda *a: chosen.append(1) or choose(*a))
    monkeypatch.setattr(drafting, "depths", lambda d: steps.append(1) or depths(d))
    outs = lm.generate(PROMPTS, SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=48, speculative={
            "method": "replay", "num_speculative_tokens": 3, "corrupt_rate": 0.0,
            "adaptive": True}))
    assert summary(outs) == summary(plain)
    st = ctl.stats["replay"].to_dict()
    assert st["depth_histogram"].get("3", 0) > st["steps"] // 2  # drafted 3 deep mostly
    if not uniform:
        assert len(chosen) == len(steps)
    else:  # held between probes, every 4 steps at first
        assert len(steps) // 4 <= len(chosen) < len(steps) - 2
