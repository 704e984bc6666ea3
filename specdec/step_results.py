"""After the target pass: verify every sampling sequence, commit KV, append tokens, finish."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from drafters.tree import DraftTree, depths_of
from specdec.outputs import RequestOutput, SpecMetrics, TokenLogprob
from specdec.sampler import (
    RowContext,
    greedy_tokens,
    host_to_device,
    logprobs_of,
    process_logits,
)
from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.verifier import verify_greedy_lists, verify_tree

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.model_runner import StepOutput
    from specdec.scheduler import StepPlan


def apply_verified(
    engine: LLMEngine,
    out: StepOutput,
    samplers: list[tuple[Sequence, int]],
    tree_lists: list[tuple[list[int], list[int]]],
    tree: DraftTree | None,  # tree_lists with draft probabilities as one batch; None: all greedy
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,  # None: no row has penalties
    row_offsets: list[int],
    plan: StepPlan,
) -> list[RequestOutput]:
    dev = out.logits.device
    # The logits rows of completed prefills come first in `out`, then decodes: rows_params
    # was built in the same order, so gather rows to match (usually every row, in order).
    rows: list[int] = []
    local_offsets: list[int] = []
    for off, (toks, _) in zip(row_offsets, tree_lists):
        local_offsets.append(len(rows))
        rows += range(off, off + 1 + len(toks))
    logits = out.logits  # [R, V]
    if rows != list(range(logits.shape[0])):
        logits = logits[torch.tensor(rows, dtype=torch.long, device=dev)]
    if tree is None:  # every row greedy: the engine built no batch tree
        new_h, acc_h = _verify_greedy(logits, rows_params, rows_ctx, tree_lists, local_offsets)
    else:
        new_h, acc_h = _verify_sampled(engine, logits, rows_params, rows_ctx, samplers, tree,
                                       local_offsets)
    want_lp = [s.params.logprobs is not None for s, _ in samplers]
    lp_rows: list[int] = []
    lp_tokens: list[int] = []
    for b in range(len(samplers)):
        if want_lp[b]:
            lp_rows += [local_offsets[b]] + [local_offsets[b] + 1 + a for a in acc_h[b]]
            lp_tokens += new_h[b]
    lp = None
    if lp_rows:
        top_n = max(s.params.logprobs or 0 for s, _ in samplers)
        idx = torch.tensor(lp_rows, dtype=torch.long, device=dev)
        chosen, top_v, top_i = logprobs_of(logits[idx], torch.tensor(lp_tokens, device=dev),
                                           top_n)
        lp = (chosen.tolist(), top_v.tolist(), top_i.tolist())

    bm = engine.blocks
    num_prefills = sum(p.completes for p in plan.prefills)
    src: list[int] = []
    dst: list[int] = []
    outputs: list[RequestOutput] = []
    lp_cursor = 0
    now = time.monotonic()
    for b, (seq, ctx) in enumerate(samplers):
        toks, pars = tree_lists[b]
        new, accepted = new_h[b], acc_h[b]
        n = len(new)
        is_decode = b >= num_prefills
        if is_decode and out.features is not None and engine.wants_features(seq):
            q0 = out.query_offsets[len(plan.prefills) + b - num_prefills]
            rows = torch.tensor([q0] + [q0 + 1 + a for a in accepted], device=dev)
            engine._drafter_of(seq).observe(
                seq.request_id, ctx, [seq.last_token] + new[:len(accepted)],
                engine.features_for(out, engine._capture_layers(plan), seq, rows))
        if is_decode:
            # KV of the accepted path moves to consecutive positions after the root.
            for j, a in enumerate(accepted):
                if a != j:
                    src.append(bm.slot(seq, ctx + 1 + a))
                    dst.append(bm.slot(seq, ctx + 1 + j))
            bm.commit(seq, ctx + 1 + len(accepted))
        else:
            bm.commit(seq, seq.num_tokens)  # a completed prefill: every token has its KV
        if seq.request_id in engine._spec and is_decode:
            depth = max(depths_of(pars), default=0)
            _record(engine, seq, len(toks), len(accepted), n, depth)
        logprobs = None
        if want_lp[b] and lp is not None:
            k = seq.params.logprobs or 0
            logprobs = [TokenLogprob(t, lp[0][lp_cursor + i],
                                     dict(zip(lp[2][lp_cursor + i][:k], lp[1][lp_cursor + i][:k])))
                        for i, t in enumerate(new)]
            lp_cursor += n
        outputs.append(settle(engine, seq, new, logprobs, now))
    engine.runner.move_kv(src, dst)
    return outputs


def settle(engine: LLMEngine, seq: Sequence, new: list[int], logprobs: list | None,
           now: float) -> RequestOutput:
    """Append a sequence's new tokens (whose KV is committed), up to its first stop condition;
    finish it if one was met; return its output."""
    kept, reason = finish_check(engine, seq, new)
    if logprobs is not None:
        logprobs = logprobs[:len(kept)]
    seq.output_token_ids += kept
    if seq.first_token_time is None:
        seq.first_token_time = now
    if seq.spec_method != "none" and reason is None:
        engine._drafter_of(seq).accepted(seq.request_id, seq.num_tokens, kept)
    if reason is None and seq.num_tokens >= engine.max_model_len:
        reason = "length"
    if reason is not None:
        seq.finish_reason = reason
        engine.scheduler.finish(seq)
        engine._release_drafter(seq)
    return engine._output(seq, kept, logprobs, finished=reason is not None)


def _verify_greedy(
    logits: torch.Tensor,  # [R, V] raw, each sequence's root row then its nodes' rows
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,
    tree_lists: list[tuple[list[int], list[int]]],
    local_offsets: list[int],
) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence (emitted tokens, accepted local nodes) when every sequence is greedy: one
    argmax over all rows, one copy to the host, then the verifier's greedy rule on lists."""
    argmax = greedy_tokens(logits, rows_params, rows_ctx).tolist()  # the step's host sync
    return verify_greedy_lists(argmax, tree_lists, local_offsets)


def _verify_sampled(
    engine: LLMEngine,
    logits: torch.Tensor,  # [R, V] raw
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,
    samplers: list[tuple[Sequence, int]],
    tree: DraftTree,
    local_offsets: list[int],
) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence (emitted tokens, accepted local nodes) through the tree verifier."""
    res = accept_on_device(engine, logits, rows_params, rows_ctx, [s for s, _ in samplers],
                           tree, local_offsets)
    # The step's one host synchronisation: results come back together.
    bsz, width = res.tokens.shape
    packed = torch.cat([res.tokens.flatten(), res.num_tokens,
                        res.accepted_nodes.flatten()]).tolist()
    num_h = packed[bsz * width:bsz * width + bsz]
    acc = packed[bsz * width + bsz:]
    new_h = [packed[b * width:b * width + num_h[b]] for b in range(bsz)]
    acc_h = [acc[b * (width - 1):b * (width - 1) + num_h[b] - 1] for b in range(bsz)]
    return new_h, acc_h


def accept_on_device(
    engine: LLMEngine,
    logits: torch.Tensor,  # [R, V] raw
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,
    seqs: list[Sequence],
    tree: DraftTree,
    local_offsets: list[int],  # per sequence, its root's row
):
    """The tree verifier's result (see specdec/verifier.py) for a step's rows, left on the
    device: nothing here waits for the device."""
    dev = logits.device
    probs = process_logits(logits, rows_params, rows_ctx)
    # Uniforms per sequence from its own generator: one per node, then one for the bonus.
    sizes = tree.sizes()
    us = [torch.zeros(n + 1) if seq.params.greedy
          else torch.rand(n + 1, generator=engine._gens[seq.request_id])
          for seq, n in zip(seqs, sizes)]
    u = torch.cat(us)  # [R]
    if tree.num_nodes:
        bonus_at = [o + n for o, n in zip(local_offsets, sizes)]
        is_node = torch.ones(len(u), dtype=torch.bool)
        is_node[bonus_at] = False
        node_u, bonus_u = u[is_node], u[~is_node]
    else:
        node_u, bonus_u = u[:0], u
    greedy = host_to_device([s.params.greedy for s in seqs], torch.bool, dev)
    verify = verify_tree
    if dev.type == "cuda":
        from verify_kernels.acceptance import accept_tree as verify  # one launch for the batch
    return verify(probs, host_to_device(local_offsets, torch.long, dev), tree, greedy,
                  node_u.to(dev, non_blocking=True), bonus_u.to(dev, non_blocking=True))


def _record(engine: LLMEngine, seq: Sequence, drafted: int, accepted: int, emitted: int,
            depth: int) -> None:
    engine._spec[seq.request_id].record(drafted, accepted, emitted, depth)
    tot = engine.spec_totals.setdefault(seq.spec_method, SpecMetrics(method=seq.spec_method))
    tot.record(drafted, accepted, emitted, depth)


def finish_check(engine: Any, seq: Sequence, new: list[int]) -> tuple[list[int], str | None]:
    """Cut `new` at the first stop condition. Returns (tokens to keep, finish reason)."""
    p = seq.params
    kept: list[int] = []
    for t in new:
        kept.append(t)
        n_out = len(seq.output_token_ids) + len(kept)
        if n_out >= p.min_tokens:
            if t in p.stop_token_ids or (not p.ignore_eos and t in engine._eos):
                return kept, "stop"
        if n_out >= p.max_tokens:
            return kept, "length"
    if p.stop:
        detok = engine._detok[seq.request_id]
        at = detok.find_stop(seq.output_token_ids + kept, p.stop)
        if at is not None:
            return _cut_at_stop(detok, seq, kept, at), "stop"
    return kept, None


def _cut_at_stop(detok: Any, seq: Sequence, kept: list[int], at: int) -> list[int]:
    """Keep the fewest new tokens whose text reaches the stop string (which is not output)."""
    for i in range(len(kept) + 1):
        if len(detok.decode_output(seq.output_token_ids + kept[:i])) > at:
            return kept[:i]
    return kept
