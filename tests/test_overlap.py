"""Overlapped plain decoding (specdec/overlap.py) gives the outputs of step-by-step decoding.

On the CPU every op is synchronous, so these tests check the pipeline's bookkeeping (device
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
    assert lm.engine.pipeline.chained_steps >= 20
    assert lm.engine.pipeline.in_flight is None
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
    assert lm.engine.pipeline.chained_steps >= 10 and lm.engine.blocks.num_used == 0


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
    assert eng.pipeline.chained_steps > 0 and eng.blocks.num_used == 0
    assert all(r == 0 for r in eng.blocks.ref_counts)
