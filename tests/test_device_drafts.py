"""Prompt lookup on the device (specdec/device_drafts.py) proposes what the host's
`lookup_chain` proposes, and overlapped steps drafted by it give plain greedy output."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import PROMPTS

from drafters.ngram import _Index, lookup_chain
from specdec import LLM, SamplingParams, device_drafts
from specdec.device_drafts import LookupDrafts, lookup

PROMPTS = PROMPTS[:4]


def host_chain(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    idx = _Index(min_n, max_n)
    idx.update(tokens)
    return lookup_chain(tokens, idx, k)


@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 4), (2, 4, 7), (1, 1, 3), (3, 3, 5),
                                           (0, 2, 3), (3, 2, 4)])
def test_lookup_matches_the_host(min_n, max_n, k):
    rnd = random.Random(min_n * 100 + max_n * 10 + k)
    cap = 80
    seqs = []
    for _ in range(40):
        vocab = rnd.choice([2, 3, 5, 50])  # few tokens: repeats; many: often no match
        n = rnd.randint(1, cap - 1)
        seqs.append([rnd.randrange(vocab) for _ in range(n)])
    seqs += [[7], [1, 2, 1, 2, 1], [4, 4, 4], [1, 2, 3, 1, 2]]
    hist = torch.randint(0, 9, (len(seqs), cap))  # garbage past each length
    for i, t in enumerate(seqs):
        hist[i, :len(t)] = torch.tensor(t)
    length = torch.tensor([len(t) for t in seqs])
    got = lookup(hist, length, min_n, max_n, k).tolist()
    assert got == [host_chain(t, min_n, max_n, k) for t in seqs]


def test_periodic_fill_and_no_match():
    assert host_chain([1, 2, 3, 1, 2], 1, 3, 5) == [3, 1, 2, 3, 1]
    assert host_chain([5, 6, 7], 1, 3, 3) == [7, 7, 7]
    assert host_chain([4, 4], 1, 3, 4) == [4, 4, 4, 4]


def test_next_appends_each_kept_rows_emitted_tokens():
    tokens = [[1, 2, 3], [4, 5], [6]]
    src = LookupDrafts.from_tokens(tokens, 12, 1, 3, torch.device("cpu"))
    emitted = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 14, 15]])
    num = torch.tensor([2, 3, 1])
    nxt = src.next(emitted, num, torch.tensor([0, 2]), same_rows=False, bound=6)
    assert nxt.length.tolist() == [5, 2] and nxt.bound == 6
    assert nxt.hist[0, :5].tolist() == [1, 2, 3, 7, 8] and nxt.hist[1, :2].tolist() == [6, 13]
    same = src.next(emitted, num, torch.arange(3), same_rows=True, bound=6)
    assert same.length.tolist() == [5, 5, 2] and same.hist[1, :5].tolist() == [4, 5, 10, 11, 12]


def lookup_params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, speculative={
        "method": "ngram", "num_speculative_tokens": 4, "on_device": True, **kw})


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(model=str(tiny_llama), speculative={"method": "none"}, block_size=4).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))


@pytest.mark.parametrize("min_n,round_to", [(1, 256), (2, 1)])
def test_overlapped_lookup_equals_plain_and_the_host_path(tiny_llama, plain, min_n, round_to,
                                                          monkeypatch):
    # round_to 1: lookups search exactly the columns the host's bound allows, no slack.
    monkeypatch.setattr(device_drafts, "COLUMN_ROUND", round_to)
    runs = {}
    for overlap in (True, False):
        lm = LLM(model=str(tiny_llama), speculative={"method": "none"}, block_size=4,
                 overlap=overlap)
        outs = lm.generate(PROMPTS, lookup_params(48, min_n=min_n))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        eng = lm.engine
        assert eng.in_flight is None and eng.blocks.num_used == 0
        spec = eng.spec_totals["ngram"]
        runs[overlap] = (eng.chainer.chained_steps, spec.steps, spec.accepted_tokens)
    assert runs[True][0] >= 8 and runs[False][0] == 0
    # Proposals are a function of the tokens, and the tokens are plain greedy's: the same
    # steps accept the same drafts on either path.
    assert runs[True][1:] == runs[False][1:]


def test_lookup_off_the_device_keeps_branching_trees(tiny_llama, plain):
    lm = LLM(model=str(tiny_llama), speculative={"method": "none"}, block_size=4)
    outs = lm.generate(PROMPTS, SamplingParams(temperature=0, ignore_eos=True, max_tokens=48,
                                               speculative={"method": "ngram",
                                                            "num_speculative_tokens": 4}))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert lm.engine.chainer.chained_steps == 0
