"""The replay drafter: greedy output is the plain output, and tau follows the corrupt rate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from drafters import replay
from drafters.base import DraftRequest
from specdec.engine import LLMEngine
from specdec.sampling_params import SamplingParams

PROMPTS = [[5, 9, 3, 17, 22, 8], [40, 2, 2, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def _generate(engine: LLMEngine, spec: dict | None, tag: str) -> tuple[list[list[int]], dict]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative=spec)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", p, params)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    outs = [final[f"{tag}-{i}"] for i in range(len(PROMPTS))]
    return [o.token_ids for o in outs], [o.spec for o in outs]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"}, seed=0)


@pytest.fixture(scope="module")
def plain(engine) -> list[list[int]]:
    outs, _ = _generate(engine, {"method": "none"}, "plain")
    replay.clear_recorded()
    for p, o in zip(PROMPTS, outs):
        replay.record(p, o)
    return outs


def _tau(specs) -> float:
    return sum(s.emitted_tokens for s in specs) / max(1, sum(s.steps for s in specs))


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_greedy_output_equals_plain(engine, plain, rate, branches):
    spec = {"method": "replay", "num_speculative_tokens": 4, "corrupt_rate": rate,
            "branches": branches}
    outs, specs = _generate(engine, spec, f"r{rate}-b{branches}")
    assert outs == plain
    assert all(s is not None for s in specs)


def test_tau_rises_as_corrupt_rate_falls(engine, plain):
    taus = []
    for rate in (1.0, 0.5, 0.2, 0.0):
        spec = {"method": "replay", "num_speculative_tokens": 4, "corrupt_rate": rate}
        _, specs = _generate(engine, spec, f"tau{rate}")
        taus.append(_tau(specs))
    assert taus == sorted(taus)
    assert taus[0] == pytest.approx(1.0)
    assert taus[-1] > 4.0  # k = 4, all accepted except where a request ends mid-chain


def test_expected_tau_and_rate_for_tau():
    assert replay.expected_tau(0.0, 4) == 5.0
    assert replay.expected_tau(1.0, 4) == 1.0
    for tau in (2.0, 3.0, 4.0, 5.0):
        r = replay.rate_for_tau(tau, 8)
        assert replay.expected_tau(r, 8) == pytest.approx(tau, abs=1e-9)


def test_tree_shape_and_script_option():
    d = replay.ReplayDrafter(target_vocab={f"t{i}": i for i in range(50)})
    req = DraftRequest("a", [1, 2, 3], max_nodes=7, k=3,
                       options={"script": {"a": [1, 2, 3, 9, 8, 7, 6]}, "branches": 3,
                                "corrupt_rate": 0.5})
    tree = d.propose([req])
    toks, pars = tree.seq(0)
    assert len(toks) == 7  # 3 levels of 3, cut at max_nodes
    assert pars[:3] == [-1, -1, -1] and pars[3:6] == [0, 0, 0] and pars[6] == 3
    clean = replay.ReplayDrafter(target_vocab={f"t{i}": i for i in range(50)})
    req.options = {"script": {"a": [1, 2, 3, 9, 8, 7, 6]}}
    assert clean.propose([req]).seq(0)[0] == [9, 8, 7]


def test_host_profile_times_the_phases_and_restores_the_engine(engine, plain, tmp_path):
    """bench/gpu_host_profile.py wraps engine functions to time them (on the GPU machine, after
    the batch-16 runs): it must hand the engine back as it found it."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        from gpu_host_profile import host_profile
    finally:
        sys.path.remove(bench)
    import torch

    import specdec.cuda_graphs as cg
    import specdec.engine as E
    from specdec.verdict import Verdict

    def wrapped():
        return (Verdict.read, engine.committer.commit, engine.outputs.build, E.verify_step,
                cg.pack_step, cg.pick_bucket, torch.cuda.CUDAGraph.replay)

    before = wrapped()
    spec = {"method": "replay", "num_speculative_tokens": 4, "corrupt_rate": 0.3}
    res = host_profile(engine, PROMPTS, spec, 40, tmp_path / "profile.txt")
    assert all(a == b for a, b in zip(wrapped(), before))  # bound methods: equal, not same
    assert res["steps_timed"] > 0
    assert {"propose", "schedule", "read_back", "launch (segments, execute, verify_step)"
            } <= set(res["phase_ms_per_step"])
    assert (tmp_path / "profile.txt").read_text()
    outs, specs = _generate(engine, spec, "after-profile")
    assert outs == plain and all(s is not None for s in specs)


def test_guesses_stay_inside_the_model_vocabulary():
    """A tokenizer may hold ids past the model's embedding rows (the Qwen2.5 benchmark shape's
    has one): random guesses, on the host and in position tables, stay below both."""
    from types import SimpleNamespace

    import torch

    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=torch.nn.Embedding(50, 1)))
    d = replay.ReplayDrafter(target_vocab={f"t{i}": i for i in range(51)}, target_model=model)
    opts = {"corrupt_rate": 1.0, "branches": 3}
    req = DraftRequest(request_id="v", tokens=[1, 2, 3], max_nodes=24, k=8, options=opts)
    seen = set()
    for _ in range(200):
        toks, _ = d._one(req)
        seen.update(toks)
    table = d.position_table(req, 400, torch.device("cpu"))
    seen.update(table.flatten().tolist())
    assert max(seen) == 49 and min(seen) >= 0


def test_speculated_output_is_prefix_cached(tiny_llama, engine, plain):
    """A follow-up whose prompt repeats a speculated answer reuses its KV blocks, those the
    accepted drafts filled included (block_manager._register_full_blocks)."""
    prompt = [33, 34, 35, 36, 37, 38, 39]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    other = LLMEngine.from_args(str(tiny_llama), speculative={"method": "none"}, seed=0)
    other.add_request("p", prompt, greedy)
    want = None
    while other.has_unfinished():
        want = next((o for o in other.step() if o.finished), want)
    replay.record(prompt, want.token_ids)  # this engine has never run the prompt plainly

    def run(rid, tokens, params):
        engine.add_request(rid, tokens, params)
        done = None
        while engine.has_unfinished():
            done = next((o for o in engine.step() if o.finished), done)
        return done

    spec = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative={
        "method": "replay", "num_speculative_tokens": 4, "corrupt_rate": 0.0})
    out = run("cache-spec", prompt, spec)
    assert out.token_ids == want.token_ids and out.spec.accepted_tokens > 0
    follow = prompt + out.token_ids + [7]
    done = run("cache-follow", follow, SamplingParams(temperature=0.0, max_tokens=1))
    bs = engine.blocks.block_size
    assert done.num_cached_tokens == (len(follow) - 1) // bs * bs > 0


def test_survival_profile_sets_acceptance_per_depth(engine, plain):
    # A profile instead of one corrupt rate: all accepted, then nothing past depth 1.
    full, _ = _generate(engine, {"method": "replay", "num_speculative_tokens": 3,
                                 "survival": "1,1,1"}, "s-full")
    cut, specs = _generate(engine, {"method": "replay", "num_speculative_tokens": 3,
                                    "survival": "1,0"}, "s-cut")
    assert full == plain and cut == plain
    assert all(s.accepted_per_position[1:] == [0] * (len(s.accepted_per_position) - 1)
               for s in specs)
    assert all(s.accepted_per_position[0] > 0 for s in specs)


def test_a_profile_replays_the_same_luck_for_the_same_prompt(engine, plain):
    """A profile's draws are fixed by the recorded prompt, the output position and how many
    times it was proposed, not by the request id: two runs drafting alike accept alike (a
    benchmark compares configurations on the same luck), and the acceptance still follows
    the profile."""
    spec = {"method": "replay", "num_speculative_tokens": 2, "survival": "0.6,0.3"}
    first, a = _generate(engine, spec, "luck-a")
    second, b = _generate(engine, spec, "luck-b")
    assert first == second == plain
    assert [s.accepted_per_position for s in a] == [s.accepted_per_position for s in b]
    shifted, c = _generate(engine, spec | {"seed": 7}, "luck-c")  # the seed does not key it
    assert [s.accepted_per_position for s in c] == [s.accepted_per_position for s in a]
    # Over many positions the first position's acceptance is the profile's S_1.
    cur = replay._Cursor(0, list(range(4000)), 0, (1, 2, 3))
    fates = [replay._common_draw(cur.key, p, 0) >= 0.4 for p in range(4000)]
    assert 0.57 < sum(fates) / len(fates) < 0.63
    again = [replay._common_draw(cur.key, p, 1) >= 0.4 for p in range(4000)]
    assert 0.57 < sum(again) / len(again) < 0.63 and again != fates  # a fresh draw per try


@pytest.mark.parametrize("bad", ["x", "0.5,0.7", "1.2"])
def test_survival_profile_is_checked_at_admission(bad):
    from drafters import check_speculative

    with pytest.raises(ValueError, match="speculative.survival"):
        check_speculative({"method": "replay", "survival": bad})


@pytest.mark.parametrize("method", ["replay", "ngram"])
def test_a_first_proposal_reports_the_context_it_read_as_catch_up(method):
    # A new request's first proposal reads its whole context (replay: its script by its
    # prompt; n-gram: an index of it), which a usual proposal does not: the controller must not
    # time drafting by it (SpeculationController.record_draft drops catch-ups over 2 tokens).
    from drafters import create_drafter

    d = create_drafter(method, target_vocab={f"t{i}": i for i in range(50)})
    prompt = [1, 2, 3, 4, 1, 2, 3, 4] * 8
    replay.record(prompt, [5, 6, 7, 8])
    try:
        def ask(rid, tokens):
            d.propose([DraftRequest(rid, tokens, max_nodes=4, k=4, options={})])
            return d.last_catch_up

        assert ask("a", prompt) == len(prompt)
        assert ask("a", prompt + [5]) == 1
        assert ask("b", prompt[:40]) == 40  # one new request in the batch is enough
        d.propose([DraftRequest(r, prompt + [5, 6], max_nodes=4, k=4, options={})
                   for r in ("a", "c")])
        assert d.last_catch_up == len(prompt) + 2
    finally:
        replay.clear_recorded()
