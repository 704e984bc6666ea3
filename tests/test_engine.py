"""End-to-end engine invariants on tiny random models (float32, CPU)."""

from __future__ import annotations

import random

import pytest

from drafters.base import DraftRequest
from specdec import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [7, 8, 9],
    list(range(2, 50)),
    [5] * 30,
    [9, 10, 11, 9, 10, 11, 9, 10, 12, 13, 9, 10],
    list(range(60, 2, -3)),
]


def plain(model, **kw) -> LLM:
    return LLM(model=str(model), speculative={"method": "none"}, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = plain(tiny_llama)
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def test_mixed_batch_equals_each_alone(tiny_llama, reference):
    outs = plain(tiny_llama, max_num_batched_tokens=40).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_preemption_keeps_outputs(tiny_llama, reference):
    llm = plain(tiny_llama, block_size=4, num_blocks=24, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.blocks.num_used == 0


def test_prefix_cache_hits_keep_outputs(tiny_llama, reference):
    llm = plain(tiny_llama, block_size=4)
    llm.generate(PROMPTS, GREEDY)
    hits_before = llm.engine.blocks.prefix_hits
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.blocks.prefix_hits > hits_before
    assert any(o.num_cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == reference


SPECS = [
    {"method": "ngram", "num_speculative_tokens": 4, "branches": 1},
    {"method": "ngram", "num_speculative_tokens": 5, "branches": 3},
    {"method": "draft_model", "num_speculative_tokens": 3},
    {"method": "draft_model", "num_speculative_tokens": 3, "branches": 2},
    # The goodput controller chooses depths (and for auto, per sequence, the drafter).
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": True},
    {"method": "auto", "num_speculative_tokens": 4},
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['method']}-b{s.get('branches', 1)}"
                         + ("-adaptive" if s.get("adaptive") else ""))
def test_greedy_speculation_equals_plain_at_batch_1(tiny_llama, tiny_draft, reference, spec):
    if spec["method"] in ("draft_model", "auto"):
        spec = dict(spec, draft_model=str(tiny_draft))
    llm = LLM(model=str(tiny_llama), speculative=spec)
    for prompt, ref in zip(PROMPTS, reference):
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == ref
        assert out.spec is not None and out.spec.steps > 0
    assert llm.engine.blocks.num_used == 0


def test_mixed_drafters_in_one_batch_of_8(tiny_llama, tiny_draft, reference):
    llm = LLM(model=str(tiny_llama), speculative={"method": "draft_model",
                                                  "draft_model": str(tiny_draft)})
    # The draft model's own draft: it accepts everything, exercising the all-accepted case.
    self_draft = {"method": "draft_model", "draft_model": str(tiny_llama),
                  "num_speculative_tokens": 4}
    specs = [SPECS[0], SPECS[1], SPECS[2], SPECS[3], {"method": "none"}, self_draft, None,
             SPECS[1]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=s)
              for s in specs]
    outs = llm.generate(prompts, params)
    for i, o in enumerate(outs):
        assert o.token_ids == reference[i % len(PROMPTS)], specs[i]
    assert outs[4].spec is None
    assert outs[5].spec.tau > 3.0  # a self-draft accepts every token
    assert llm.engine.blocks.num_used == 0


def test_a_draft_model_reading_a_window_of_the_sequence_keeps_outputs(tiny_llama, reference):
    # The target as its own draft model, reading at most the last 16 tokens when it starts on
    # a sequence (at their own positions): outputs stay plain greedy's, and where it falls
    # further behind than 16 tokens it starts again from the last 16.
    spec = {"method": "draft_model", "draft_model": str(tiny_llama),
            "num_speculative_tokens": 4, "context": 16}
    llm = LLM(model=str(tiny_llama), speculative=spec)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.spec.draft_tokens > 0 for o in outs)
    d = llm.engine.drafting.drafter(llm.engine.drafting.resolve(None))
    assert d.catch_up_tokens(100, {"context": 16}) == 16 and d.catch_up_tokens(5, {}) == 5

    def propose(tokens: list[int]) -> int:
        d.propose([DraftRequest("x", tokens, 4, 4, {"context": 16}, GREEDY)])
        return d.last_catch_up

    seq = [i % 40 + 1 for i in range(100)]
    assert propose(seq[:40]) == 16  # a 40-token prompt: its last 16
    d.accepted("x", 41, [])  # none of the draft kept
    assert propose(seq[:41]) == 1  # the next token only
    assert propose(seq[:90]) == 16  # 49 behind: started again
    d.release("x")
    assert llm.engine.blocks.num_used == 0 and d.blocks.num_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "overlap"])
def test_random_aborts_free_every_block(tiny_llama, tiny_draft, overlap):
    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram"}, block_size=4,
              num_blocks=200, max_num_seqs=16, overlap=overlap)
    eng = llm.engine
    rng = random.Random(0)
    live: set[str] = set()
    n = 0
    for _ in range(400):
        if n < 200 and rng.random() < 0.6:
            rid = f"r{n}"
            spec = rng.choice([None, {"method": "none"}, SPECS[1],
                               {"method": "draft_model", "draft_model": str(tiny_draft)}])
            prompt = [rng.randrange(1, 8) for _ in range(rng.randrange(2, 30))]
            eng.add_request(rid, prompt, SamplingParams(
                temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 20),
                speculative=spec, seed=n))
            live.add(rid)
            n += 1
        if live and rng.random() < 0.15:
            eng.abort_request(rng.choice(sorted(live)))
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
    assert n == 200 and not live
    assert eng.blocks.num_used == 0
    assert all(r == 0 for r in eng.blocks.ref_counts)
    for d in eng.drafting.drafters.values():
        if hasattr(d, "blocks"):
            assert d.blocks.num_used == 0


def test_seeded_sampling_is_reproducible(tiny_llama):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=123, ignore_eos=True)
    a = LLM(model=str(tiny_llama), speculative={"method": "ngram"}).generate(PROMPTS, p)
    b = LLM(model=str(tiny_llama), speculative={"method": "ngram"}).generate(PROMPTS[::-1], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b][::-1]


def test_stop_strings_tokens_and_logprobs(tiny_llama, reference):
    llm = plain(tiny_llama)
    ref_text = llm.generate([PROMPTS[0]], GREEDY)[0].text
    words = ref_text.split()
    stop = " ".join(words[3:5])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert ref_text.startswith(out.text.rstrip())
    out = llm.generate([PROMPTS[0]], SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[reference[0][5]], ignore_eos=True))[0]
    assert out.token_ids == reference[0][:6] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_streaming_deltas_add_up(tiny_llama):
    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram"})
    deltas: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    final = {}
    for out in llm.stream(PROMPTS[:3], GREEDY):
        deltas.setdefault(out.request_id, []).extend(out.delta_token_ids)
        text[out.request_id] = text.get(out.request_id, "") + out.delta_text
        if out.finished:
            final[out.request_id] = out
    for rid, out in final.items():
        assert deltas[rid] == out.token_ids and text[rid] == out.text


def test_bad_requests_are_clear_errors(tiny_llama):
    llm = plain(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        llm.engine.add_request("a", list(range(1, 60)) * 2, GREEDY)
    with pytest.raises(ValueError, match="unknown speculative method"):
        llm.engine.add_request("b", [1, 2], SamplingParams(speculative={"method": "magic"}))
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.add_request("c", [1, 10_000], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("spec", [{"method": "none"},
                                  {"method": "ngram", "num_speculative_tokens": 4}],
                         ids=lambda s: s["method"])
def test_constant_kv_pressure_keeps_outputs_and_starves_nobody(tiny_llama, reference, spec):
    """A KV cache a little over the longest request (72 tokens): twelve requests preempt each
    other all the time; each still gets its unpressured output, and finishes within a bound of
    steps (each request's prompt and output computed one token a step, one request at a time,
    is far more than recomputing after preemptions takes)."""
    llm = LLM(model=str(tiny_llama), speculative=spec, block_size=4, num_blocks=20,
              max_num_batched_tokens=32)
    eng = llm.engine
    preempted = 0
    schedule = eng.scheduler.schedule

    def counting(*args, **kw):
        nonlocal preempted
        plan = schedule(*args, **kw)
        preempted += len(plan.preempted)
        return plan

    eng.scheduler.schedule = counting
    prompts = PROMPTS * 2
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    done: dict[str, list[int]] = {}
    bound = sum(len(p) + GREEDY.max_tokens for p in prompts)
    steps = 0
    while eng.has_unfinished():
        steps += 1
        assert steps <= bound, f"{len(done)} of {len(prompts)} finished after {bound} steps"
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[str(i)] for i in range(len(prompts))] == reference * 2
    assert preempted >= len(prompts)
    assert eng.blocks.num_used == 0


def test_a_draft_models_chain_stops_where_the_draft_is_unsure(tiny_llama, tiny_draft,
                                                               reference):
    # `p_min`: a chain ends with the first token whose probability the draft model gives under
    # p_min (its most likely at that depth), proposed as the chain's last. Outputs stay plain
    # greedy's; a higher bar drafts fewer tokens, and one that no softmax reaches drafts one a
    # chain.
    drafted = {}
    for p_min in (0.0, 0.12, 1.0):
        spec = {"method": "draft_model", "draft_model": str(tiny_draft),
                "num_speculative_tokens": 4, "p_min": p_min}
        llm = LLM(model=str(tiny_llama), speculative=spec)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        drafted[p_min] = sum(o.spec.draft_tokens for o in outs)
        if p_min == 1.0:
            assert all(sum(o.spec.drafted_per_position[1:]) == 0 for o in outs)
            assert all(o.spec.drafted_per_position[0] > 0 for o in outs)
        assert llm.engine.blocks.num_used == 0
    assert drafted[0.0] > drafted[0.12] > drafted[1.0] > 0


def test_a_chain_stopped_short_is_judged_at_the_depth_it_was_asked_for(tiny_llama):
    # The target drafting for itself: every draft is accepted, and p_min 1.0 ends every chain
    # after its first token, asked 4 deep. The controller's estimate of the second position
    # then falls to near nothing (judged by the drafted tokens alone it would have learnt
    # nothing there and kept the prior's 0.64), while the first stays near 1; the reach says
    # every chain drafted one deep and none two.
    est = {}
    for p_min in (0.0, 1.0):
        spec = {"method": "draft_model", "draft_model": str(tiny_llama),
                "num_speculative_tokens": 4, "p_min": p_min}
        llm = LLM(model=str(tiny_llama), speculative=spec)
        llm.generate(PROMPTS, GREEDY)
        ctl = llm.engine.drafting.controller
        est[p_min] = ctl.survival("next", "draft_model", 2)
        if p_min == 1.0:  # asked 4 deep (less at a request's end), drafted one
            profile = ctl.evidence.drafters["draft_model"]
            assert len(profile.offered) == 4 and profile.offered[3] > profile.offered[0] / 2
            assert profile.reached[0] == pytest.approx(profile.offered[0])
            assert max(profile.reached[1:]) == 0.0
    assert est[1.0][1] < 0.1 < est[0.0][1]
    assert est[1.0][0] > 0.9


def test_the_cpu_kv_pool_hands_written_pages_back(tiny_llama, reference):
    # The step-cost calibration writes timed sequences across the pool; with no block in use
    # the engine gives those pages back (ModelRunner.release_kv_pages) and the cache reads as
    # zeros, which no block's owner can tell: outputs stay the same.
    def shmem_kb() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("RssShmem:"))
        return int(line.split()[1])

    llm = plain(tiny_llama)
    kv = llm.engine.runner.kv
    kv.fill_(1.0)
    written = shmem_kb()
    assert llm.engine.runner.release_kv_pages()
    assert written - shmem_kb() > kv.numel() * 4 // 1024 // 2
    assert not kv.any()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
