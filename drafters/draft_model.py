"""A smaller model with the target's tokenizer, run with its own paged KV cache.

Each step it catches its KV up with the sequence (the tokens the target accepted since last
time), then decodes k tokens for all its requests in batched forward passes. It starts on a
sequence from its last `context` tokens at most (positions as in the sequence): on a CPU the
draft model reads a prompt at ~1.6 ms a token, so a 1,536-token code prompt read whole cost
2.4 s and left speculation at 0.41x plain decoding over 96 tokens, where its last 256 tokens
cost 0.4 s and gave 0.74x at tau 2.59 against 2.91 (fixed depth 4; HumanEval's prompts, 80-120
tokens, are read whole either way; bench/results/cpu_draft_context_20261203.json). Where it
has fallen further behind (steps it sat out), it starts again the same way. Chain mode samples
each token from the draft distribution (the request's own sampling transforms applied) and
reports that distribution; tree mode adds, at every depth, the next `branches - 1` most likely
tokens as deterministic siblings of the chain's node.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from drafters.base import Drafter, DraftRequest, Option, register
from drafters.tree import DraftTree
from specdec.block_manager import BlockManager
from specdec.config import CacheConfig, ModelConfig, RuntimeConfig, resolve_model_config
from specdec.model_runner import ModelRunner
from specdec.models.heap import release_freed_memory
from specdec.sampler import argmax_rows, host_to_device, process_logits
from specdec.sequence import Sequence
from specdec.step_inputs import Segment
from verify_kernels.reference import sample_inverse_cdf


@register
class DraftModelDrafter(Drafter):
    """Options: `branches` (default 1: a chain), `context` (the most tokens of a sequence it
    reads when it starts on one, default DRAFT_CONTEXT), `p_min` (a chain ends with the first
    token the draft model gives less than this probability, its most likely at that depth:
    proposed as the chain's last, since its pass is paid; default DRAFT_P_MIN, 0 drafts every
    depth asked for)."""

    name = "draft_model"
    stops_short = True
    options = {"draft_model": Option(str), "branches": Option(int, 1, 8),
               "context": Option(int, 16, 1 << 20), "p_min": Option(float, 0.0, 1.0)}

    def __init__(self, draft_model: str, target: ModelConfig, cache: CacheConfig,
                 target_vocab: dict[str, int] | None = None,
                 runtime: RuntimeConfig | None = None, **_: Any) -> None:
        # Where the target runs quantized (the CPU), the draft runs in 4 bits: its guesses need
        # not be exact (the target verifies them), only cheap. Q5_0 -> 4 bits costs little
        # acceptance and 40% of the draft's bytes (bench/results/cpu_draft_*.json).
        quant = "none" if target.quantization == "none" else DRAFT_QUANTIZATION
        mc = resolve_model_config(ModelConfig(model=draft_model, dtype=target.dtype,
                                              device=target.device, quantization=quant,
                                              cpu_kernel=target.cpu_kernel))
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {draft_model!r} has vocab_size {mc.vocab_size}, the "
                             f"target {target.vocab_size}: a draft model must share the "
                             "target's tokenizer")
        if target_vocab is not None:
            from transformers import AutoTokenizer

            vocab = AutoTokenizer.from_pretrained(mc.path).get_vocab()
            if vocab != target_vocab:
                raise ValueError(f"draft model {draft_model!r} has a different tokenizer "
                                 "vocabulary from the target's")
        draft_cache = replace(cache, num_blocks=None, enable_prefix_caching=False,
                              cpu_kv_bytes=cache.cpu_kv_bytes // 2,
                              gpu_memory_utilization=cache.gpu_memory_utilization * 0.25)
        self.runner = ModelRunner(mc, draft_cache, runtime=runtime)
        self.vocab_size = mc.vocab_size
        # The draft's output vocabulary where it is reduced (ReducedHead): its passes' logits
        # have one column per id here, and a proposal maps back through it.
        self.head_ids: torch.Tensor | None = None
        if mc.quantization != "none" and DRAFT_VOCAB < mc.vocab_size:
            self.reduce_vocabulary(draft_vocab_ids(special_token_ids(mc.path), DRAFT_VOCAB))
        self.blocks = BlockManager(self.runner.num_blocks, draft_cache.block_size, False)
        if self.runner.device.type == "cpu":
            # The reduced head's conversion too; a draft model built on a first request (the
            # Python API) gets no other: with it loaded, 48 prompts in, a process held 2.92 GB
            # without this and 2.25 GB with it (bench/results/
            # cpu_rss_inprocess_20261207_spec_untrimmed.log, _spec.log).
            release_freed_memory()
        self.last_catch_up = 0  # tokens fed before the first draft of the last proposal
        self._seqs: dict[str, Sequence] = {}
        self._start: dict[str, int] = {}  # the sequence position its draft state starts at
        # Per request after propose: (tokens up to the root, chain tokens whose KV was computed).
        self._fed: dict[str, tuple[int, list[int]]] = {}

    def reduce_vocabulary(self, ids: torch.Tensor) -> None:
        """Draft from the tokens `ids` (sorted, int64) alone: the output layer computes only
        their rows, and the proposal's softmax, pick and siblings work over them (on the CPU a
        0.5b draft step's output layer and its pick over 152k columns took 1.5 ms of 10)."""
        self.runner.model.lm_head = ReducedHead(self.runner.model.lm_head, ids)
        self.head_ids = ids.to(self.runner.device)

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        return k * max(1, int(options.get("branches", 1)))

    def catch_up_tokens(self, behind: int, options: dict[str, Any]) -> int:
        return min(behind, _context(options))

    def _state(self, r: DraftRequest) -> tuple[Sequence, int]:
        """The draft's sequence for `r` (its tokens from `start` on) and `start`."""
        rid, window = r.request_id, _context(r.options)
        s = self._seqs.get(rid)
        if s is not None and len(r.tokens) - self._start[rid] - s.num_computed > window:
            self.release(rid)  # further behind than a fresh start would read
            s = None
        if s is None:
            s = self._seqs[rid] = Sequence(rid, [], r.params)
            self._start[rid] = max(0, len(r.tokens) - window)
            self.blocks.allocate_prefix(s)
        start = self._start[rid]
        s.prompt_token_ids = r.tokens[start:]
        return s, start

    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        states, starts = zip(*(self._state(r) for r in batch)) if batch else ((), ())
        depth = [min(r.k, r.max_nodes // max(1, int(r.options.get("branches", 1))))
                 for r in batch]
        # Tokens each sequence feeds this pass: first its catch-up chunk (ending at the root).
        feed = [s.tokens[s.num_computed:] for s in states]
        self.last_catch_up = max((len(f) for f in feed), default=0)
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        live = [d > 0 and self.blocks.reserve(s, len(f) + d)
                for s, f, d in zip(states, feed, depth)]
        self.last_asked = [d if ok else 0 for d, ok in zip(depth, live)]
        last_chain = [-1] * len(batch)
        for step in range(max(depth, default=0)):
            active = [i for i in range(len(batch)) if live[i] and step < depth[i]]
            if not active:
                break
            segs = []
            for i in active:
                s, f = states[i], feed[i]
                at = starts[i] + s.num_computed
                segs.append(Segment(
                    tokens=f, positions=list(range(at, at + len(f))),
                    slots=[self.blocks.slot(s, s.num_computed + j) for j in range(len(f))],
                    context_len=s.num_computed, block_table=s.block_table,
                    logits_rows=(len(f) - 1,)))
            out = self.runner.execute(segs)
            reqs = [batch[i] for i in active]
            # Logits [A, V], or [A, len(head_ids)] over the reduced vocabulary.
            q = None  # the sampled rows' draft distributions
            if all(r.params.greedy for r in reqs):
                picked = argmax_rows(out.logits)[:, None]  # [A, 1]
            else:
                q = process_logits(out.logits, [r.params for r in reqs], None)
                picked = _pick(q, reqs)[:, None]
            p_min = [_p_min(r.options) for r in reqs]
            sure = None  # [A]: whether the draft model's top probability at this depth (its
            if max(p_min) > 0.0:  # own softmax, whatever the request samples) reaches p_min
                top = torch.softmax(out.logits.float(), dim=-1).max(dim=-1).values
                sure = top >= host_to_device(p_min, torch.float32, top.device)
            width = max(max(1, int(r.options.get("branches", 1))) for r in reqs)
            if width > 1:  # the next most likely tokens by the draft's logits, for siblings
                picked = torch.cat([picked, out.logits.topk(width, dim=-1).indices], dim=1)
            if self.head_ids is not None:
                picked = self.head_ids[picked]
                if q is not None:  # sampled chains report q over the vocabulary
                    q = q.new_zeros(len(reqs), self.vocab_size).index_copy_(1, self.head_ids, q)
            if sure is not None:  # read with the tokens, as the last column
                picked = torch.cat([picked, sure[:, None].long()], dim=1)
            host = picked.tolist()  # the depth's one read for the whole batch
            for a, i in enumerate(active):
                r, s = batch[i], states[i]
                s.num_computed += len(feed[i])
                if sure is not None and not host[a][-1]:
                    # The draft is unsure of its next token: that token is its chain's last
                    # (what stops it is the draft's own distribution, so the verified output
                    # keeps the target's). Proposed, not dropped: its pass is paid either way,
                    # and a dropped one left a pass that drafted nothing in every chain cut.
                    depth[i] = step + 1
                tok = host[a][0]
                branches = max(1, int(r.options.get("branches", 1)))
                toks, pars = trees[i]
                parent = last_chain[i]
                toks.append(tok)
                pars.append(parent)
                last_chain[i] = len(toks) - 1
                if branches > 1 or r.params.greedy:
                    probs[i] = []  # deterministic proposals: point masses
                    alts = [t for t in host[a][1:1 + branches] if t != tok]
                    for t in alts[:branches - 1]:
                        toks.append(t)
                        pars.append(parent)
                else:
                    probs[i].append(q[a])  # stays on the device, where the verifier reads it
                feed[i] = [tok]
        for i, s in enumerate(states):
            if live[i]:
                # The draft KV now covers the root and the chain tokens fed after it; `accepted`
                # keeps the part the target agreed with.
                fed = s.num_computed - len(s.tokens)
                chain = [trees[i][0][j] for j in _chain_nodes(trees[i][1])][:fed]
                self._fed[batch[i].request_id] = (len(s.tokens), chain)
        out_probs = [torch.stack(p) if p and len(p) == len(trees[i][0]) else None
                     for i, p in enumerate(probs)]
        return DraftTree.from_lists(trees, out_probs, self.vocab_size)

    def accepted(self, request_id: str, num_tokens: int, tokens: list[int]) -> None:
        s = self._seqs.get(request_id)
        fed = self._fed.pop(request_id, None)
        if s is None or fed is None:
            return
        root_len, chain = fed
        match = 0
        while match < len(chain) and match < len(tokens) and chain[match] == tokens[match]:
            match += 1
        # Valid draft KV: everything up to the root, plus the fed chain tokens the target
        # accepted. The next catch-up chunk starts after them (often just the bonus token).
        self.blocks.commit(s, min(s.num_computed, root_len + match))

    def release(self, request_id: str) -> None:
        self._fed.pop(request_id, None)
        self._start.pop(request_id, None)
        s = self._seqs.pop(request_id, None)
        if s is not None:
            self.blocks.free_seq(s)


DRAFT_QUANTIZATION = "int4"
DRAFT_VOCAB = 32768
# The first read of a sequence is the draft model's one large cost, paid before any of its
# drafts are judged: at 256 tokens 0.49 s on the 2-core CPU, 12% of a ShareGPT request that
# then drafted nothing (prompt 4 at 0.85x of plain, bench/results/
# cpu_vs_llamacpp_20261207_attn_sharegpt.json). Reading 128 drafted as well as 256-512 did
# (tau 3.43 on HumanEval, 2.78 on ShareGPT: bench/results/cpu_draft_context_20261203.json).
DRAFT_CONTEXT = 128
# A chain ends with the first token the draft gives under 0.8, and drafts up to 8 deep where
# the engine's default speculation is the draft model (specdec/config.py, DRAFT_DEPTH). Priced
# from chains recorded 8 deep with the CPU pair and this machine's passes (bench/results/
# cpu_draft_confidence_20261207_k8.json), the best of every rule, threshold and depth there on
# HumanEval and ShareGPT alike: 1.73x / 1.44x of plain at 8 deep (1.74x / 1.44x at 7), where
# the chain cut before its first token under 0.5 at 4 deep, as before, read 1.655x / 1.325x,
# and cut before that token at any threshold and depth at most 1.68x / 1.34x: such a cut paid
# the pass that found the draft unsure for nothing. Deeper chains pay once that token ends them.
DRAFT_P_MIN = 0.8


def _context(options: dict[str, Any]) -> int:
    return int(options.get("context", DRAFT_CONTEXT))


def _p_min(options: dict[str, Any]) -> float:
    return float(options.get("p_min", DRAFT_P_MIN))


def special_token_ids(path: str | None) -> list[int]:
    """Ids of a tokenizer's added and special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))


def draft_vocab_ids(special: list[int], size: int) -> torch.Tensor:
    """The draft's output vocabulary: the `size` lowest ids (byte-level BPE numbers tokens in
    merge order, so these are the most frequent pieces) and every added or special token (FIM
    markers, end of turn)."""
    return torch.tensor(sorted(set(range(size)) | set(special)), dtype=torch.int64)


class ReducedHead(torch.nn.Module):
    """The draft's output layer over a subset of the vocabulary, `ids`: logits [n, len(ids)].

    Exact for speculation: a proposal distribution may be anything the verifier is told; here
    it is the draft's softmax over the subset (zero elsewhere), which is what _pick draws from
    and what the verifier reads (DraftModelDrafter.propose maps it back to the vocabulary)."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        from specdec.models.quant_linear import QuantLinear

        if isinstance(head, QuantLinear):
            assert len(head.parts) == 1
            self.sub: torch.nn.Module = QuantLinear([head.parts[0].select(ids)], None,
                                                    head.path, len(ids))
        else:
            self.sub = torch.nn.Linear(head.in_features, len(ids), bias=False)
            self.sub.weight = torch.nn.Parameter(head.weight[ids].detach(), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, len(ids)]
        return self.sub(h).float()


def _pick(q: torch.Tensor, reqs: list[DraftRequest]) -> torch.Tensor:  # [A] int64
    """Each row's draft token, on q's device: the argmax for a greedy request (its row is a
    one-hot), else a draw by the inverse CDF of one uniform from the request's own generator."""
    u = [0.0 if r.params.greedy else float(torch.rand(1, generator=r.generator)) for r in reqs]
    drawn = sample_inverse_cdf(q, host_to_device(u, torch.float32, q.device))
    greedy = host_to_device([r.params.greedy for r in reqs], torch.bool, q.device)
    return torch.where(greedy, q.argmax(dim=-1), drawn)


def _chain_nodes(parents: list[int]) -> list[int]:
    """Indices of the main chain: each node whose parent is the previous chain node."""
    chain: list[int] = []
    for i, p in enumerate(parents):
        if p == (chain[-1] if chain else -1):
            chain.append(i)
    return chain
