"""Chained plain decoding (specdec/chaining.py) gives the outputs of step-by-step decoding.

On the CPU every op is synchronous, so these tests check the chain's bookkeeping (device
tokens as inputs, KV commits one step behind, dropped work past a stop, draining on any
change of batch); the GPU runs the same code with the host work overlapped.
"""

from __future__ import annotations

from test_engine import GREEDY, PROMPTS

from specdec import LLM, SamplingParams

PROMPTS = PROMPTS[:4]


def llm(model, overlap: bool, **kw) -> LLM:
    return LLM(model=str(model), speculative={"method": "none"}, overlap=overlap, block_size=4,
               **kw)


def summary(outs):
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


def test_overlapped_batch_equals_stepwise(tiny_llama):
    ref = llm(tiny_llama, False).generate(PROMPTS, GREEDY)
    lm = llm(tiny_llama, True)
    outs = lm.generate(PROMPTS, GREEDY)
    assert summary(outs) == summary(ref)
    assert lm.engine.chainer.chained_steps >= 20
    assert lm.engine.in_flight is None
    assert lm.engine.blocks.num_used == 0


def test_stops_and_lengths_mid_pipeline(tiny_llama):
    base = llm(tiny_llama, False)
    ref = base.generate(PROMPTS, GREEDY)
    text = ref[0].text
    # Stop tokens, a stop string, eos and different lengths end requests at different steps:
    # the step launched past each end must be dropped.
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[0].token_ids[6]],
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, stop=[text[-6:-3]] if text else [],
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=2),
    ]
    want = summary(base.generate(PROMPTS, params))
    lm = llm(tiny_llama, True)
    assert summary(lm.generate(PROMPTS, params)) == want
    assert lm.engine.blocks.num_used == 0
    # The same requests one at a time: the pipeline runs at batch 1 and drains at each end.
    for p, par, w in zip(PROMPTS, params, want):
        assert summary(lm.generate([p], par)) == [w]


def test_sampled_decoding_overlapped_is_the_same_draw(tiny_llama):
    """Seeded sampling (temperature, top-k/p, min-p; greedy rows mixed in) gives the same
    tokens with the pipeline on: each step draws from each request's generator as before."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=8, max_tokens=14, seed=4, ignore_eos=True),
              GREEDY,
              SamplingParams(temperature=1.3, min_p=0.05, max_tokens=24, seed=5)]
    want = summary(llm(tiny_llama, False).generate(PROMPTS, params))
    lm = llm(tiny_llama, True)
    assert summary(lm.generate(PROMPTS, params)) == want
    assert lm.engine.chainer.chained_steps >= 10 and lm.engine.blocks.num_used == 0


def test_arrivals_and_aborts_drain_the_pipeline(tiny_llama):
    ref = {i: o.token_ids for i, o in enumerate(llm(tiny_llama, False).generate(
        PROMPTS, GREEDY))}
    lm = llm(tiny_llama, True, max_num_seqs=8)
    eng = lm.engine
    done: dict[str, object] = {}
    added = 0
    sampled = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    for step in range(200):
        if added < 12 and step % 3 == 0:
            rid = f"r{added}"
            # Every third request samples (seeded): the pipeline carries it too.
            eng.add_request(rid, PROMPTS[added % 4], sampled if added % 3 == 2 else GREEDY)
            added += 1
        if step == 10:
            eng.abort_request("r1")
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if added == 12 and not eng.has_unfinished():
            break
    assert len(done) == 12 and done["r1"].finish_reason == "abort"
    for i in range(12):
        rid = f"r{i}"
        if rid != "r1" and i % 3 != 2:
            assert done[rid].token_ids == ref[i % 4], rid
    # A sampled request gives what it gives alone with its seed.
    alone = llm(tiny_llama, False).generate([PROMPTS[2]], sampled)[0].token_ids
    assert done["r2"].token_ids == alone
    assert eng.chainer.chained_steps > 0 and eng.blocks.num_used == 0
    assert all(r == 0 for r in eng.blocks.ref_counts)


def spec_summary(outs):
    return [(o.token_ids, o.finish_reason, o.text,
             None if o.logprobs is None else [(lp.token_id, round(lp.logprob, 4))
                                              for lp in o.logprobs],
             None if o.spec is None else (o.spec.steps, o.spec.accepted_tokens))
            for o in outs]


def test_speculative_steps_read_back_a_step_late(tiny_llama, tiny_draft):
    """With overlap on, a speculative (or prefill, or mixed) step is read back by the next
    step after that one has launched its pass. Drafters, trees, seeded sampling, penalties,
    logprobs and stops mid-batch give what step-by-step reading gives."""
    text = llm(tiny_llama, False).generate(PROMPTS[:1], GREEDY)[0].text
    third = len(text) // 3
    draft = {"method": "draft_model", "draft_model": str(tiny_draft), "num_speculative_tokens": 3}
    self_draft = {"method": "draft_model", "draft_model": str(tiny_llama),
                  "num_speculative_tokens": 4, "branches": 2}
    cases = [
        ({"method": "ngram", "num_speculative_tokens": 4}, dict(stop=[text[third:third + 3]])),
        ({"method": "ngram", "num_speculative_tokens": 5, "branches": 3}, dict(logprobs=2)),
        (draft, dict(temperature=1.0, top_p=0.9, seed=11)),
        ({**draft, "branches": 2}, dict(temperature=0.8, seed=12, repetition_penalty=1.3)),
        ({"method": "none"}, dict(max_tokens=9)),
        (self_draft, dict(stop_token_ids=[7, 9])),
        (self_draft, dict(temperature=1.0, seed=13, logprobs=1)),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 20, "ignore_eos": True,
                                "speculative": s, **kw}) for s, kw in cases]

    def run(overlap: bool):
        lm = LLM(model=str(tiny_llama), speculative=draft, overlap=overlap, block_size=4)
        outs = lm.generate(prompts, params)
        assert lm.engine.in_flight is None and lm.engine.blocks.num_used == 0
        return spec_summary(outs)

    want = run(False)
    assert want[0][1] == "stop" and want[5][1] in ("stop", "length")
    assert run(True) == want


def test_eagle_features_with_steps_read_back_late(tiny_llama, tmp_path):
    """An EAGLE drafter takes the target's features of each verified step: reading the step
    back after the next one has launched keeps greedy output equal to plain decoding."""
    from test_eagle import make_head

    head = make_head(tmp_path / "head", tiny_llama, eagle3=True, seed=1)
    ref = [o.token_ids for o in llm(tiny_llama, False).generate(PROMPTS, GREEDY)]
    lm = LLM(model=str(tiny_llama), speculative={
        "method": "eagle", "eagle_head": str(head), "num_speculative_tokens": 3, "top_k": 2,
        "max_nodes": 6}, overlap=True, block_size=4)
    outs = lm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.spec.draft_tokens > 0 for o in outs) and lm.engine.blocks.num_used == 0


def test_adaptive_requests_at_depth_zero_chain_while_the_controller_rests(tiny_llama,
                                                                         monkeypatch):
    """Drafting made to lose (every draft row dear): the controller puts the batch at depth 0,
    and its plain steps chain until each probe, which is planned on the host; outputs are
    those of plain decoding."""
    from specdec.cost_model import CostModel
    from specdec.spec_control import PROBE_EVERY

    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ref = llm(tiny_llama, False).generate(PROMPTS, long)
    spec = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                          speculative={"method": "ngram", "adaptive": True})
    monkeypatch.setattr(CostModel, "pass_time", lambda self, rows: 1.0 + 10.0 * rows)
    lm = llm(tiny_llama, True)
    outs = lm.generate(PROMPTS, spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    steps = max(len(o.token_ids) for o in outs)
    assert lm.engine.chainer.chained_steps >= steps // 2
    # Probes still come: about one host-planned step every PROBE_EVERY.
    assert lm.engine.chainer.chained_steps <= steps - steps // PROBE_EVERY
    assert lm.engine.blocks.num_used == 0


def test_a_step_read_back_after_a_pause_is_not_priced(tiny_llama):
    """With overlap a step's call waits only for what is left of it on the device, which worked
    on while the caller was away: a step is priced by its call and the gap before it together
    (a caller's synchronisation in the gap no longer makes it look free), and not at all after
    the engine sat idle (specdec/cost_model.py `step_period`)."""
    import time

    from specdec.cost_model import IDLE_GAP, step_period

    assert step_period(0.005, 0.0002) == 0.0052
    assert step_period(0.0009, 0.005) == 0.0059  # the benchmark's synchronisation, in the gap
    assert step_period(0.005, IDLE_GAP + 0.01) is None and step_period(0.005, -1.0) is None
    lm = llm(tiny_llama, True)
    engine = lm.engine
    priced: dict[int, float] = {}  # engine.step call -> the seconds it recorded
    record = engine.drafting.controller.record_pass
    n = 0

    def spy(rows, seconds, *a):
        priced[n] = seconds
        record(rows, seconds, *a)

    engine.drafting.controller.record_pass = spy
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True))
    while engine.has_unfinished():
        n += 1
        if n == 6:
            time.sleep(0.5)  # the engine idle: longer than IDLE_GAP
        engine.step()
    assert 6 not in priced and len(priced) >= 4  # decode steps are priced from call 3 on
    assert max(priced.values()) < 0.5


def test_a_steps_planning_is_priced_with_that_step(tiny_llama):
    """With overlap, the host plans step n + 1 after committing step n, the device idle: that
    time is step n + 1's cost, recorded when it is committed, not step n's (a plain step
    followed by a host-planned drafted one otherwise read dearer than a plain step is)."""
    import time

    lm = llm(tiny_llama, True)
    engine = lm.engine
    engine.chainer.can_chain = lambda *a: False  # every step planned on the host
    priced: dict[int, float] = {}  # engine.step call -> the seconds it recorded
    record = engine.drafting.controller.record_pass
    depths = engine.drafting.depths
    n = 0

    def spy(rows, seconds, *a):
        priced[n] = seconds
        record(rows, seconds, *a)

    def slow_depths(decoding):
        if n == 6:
            time.sleep(0.5)  # planning the step call 6 launches, which call 7 commits
        depths(decoding)

    engine.drafting.controller.record_pass = spy
    engine.drafting.depths = slow_depths
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True))
    while engine.has_unfinished():
        n += 1
        engine.step()
    assert {5, 6, 7, 8} <= set(priced)
    assert priced[7] >= 0.5 and priced[6] < 0.5  # a tiny model's step: milliseconds
