"""After the target pass: verify every sampling sequence, commit KV, append tokens, finish.

A step's verification is launched on the device right after its target pass
(`launch_verification`) and read back later (`finish_step`): at once, or, with overlap on, by
the next engine step after it has launched its own pass (specdec/engine.py). Reading back
happens in two phases. `finish_step` does what the next step depends on: accepted tokens
appended, KV committed, drafters told, finished sequences removed from the scheduler. Building
the outputs (detokenizing) is the second phase, left until the next pass is running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from drafters.tree import DraftTree, row_shape
from specdec.outputs import RequestOutput, SpecMetrics, TokenLogprob
from specdec.sampler import (
    HostCopy,
    RowContext,
    device_to_host,
    greedy_tokens,
    host_to_device,
    logprobs_of,
    process_logits,
)
from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.stop_rules import past_budget
from specdec.target_features import capture_layers, features_for, wants_features
from specdec.verifier import verify_greedy_lists, verify_tree

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.model_runner import StepOutput
    from specdec.scheduler import StepPlan

# (sequence, its new tokens, their logprobs or None, finished): what an output is built from.
Settled = tuple[Sequence, list[int], Any, bool]


@dataclass
class PendingStep:
    """A step whose target pass and verification are launched but not read back."""

    plan: StepPlan
    out: StepOutput
    samplers: list[tuple[Sequence, int]]  # (sequence, context length before the step)
    tree_lists: list[tuple[list[int], list[int]]]  # per sampler: (draft tokens, parents)
    logits: torch.Tensor  # [R, V] raw, each sampler's root row then its nodes' rows
    local_offsets: list[int]  # per sampler, its root's row in `logits`
    greedy: bool  # every row greedy: `result` holds each row's argmax
    result: HostCopy  # argmax [R], or packed acceptance
    width: int  # acceptance: emitted-token columns per sampler
    launched: float  # time.perf_counter() at launch


def launch_verification(
    engine: LLMEngine,
    out: StepOutput,
    samplers: list[tuple[Sequence, int]],
    tree_lists: list[tuple[list[int], list[int]]],
    tree: DraftTree | None,  # tree_lists with draft probabilities as one batch; None: all greedy
    rows_params: list[SamplingParams],
    rows_ctx: list[RowContext] | None,  # None: no row has penalties
    row_offsets: list[int],
    plan: StepPlan,
    launched: float,
) -> PendingStep:
    """Queue the step's verification behind its pass and the copy of its result to the host;
    nothing here waits for the device."""
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
        logits = logits[host_to_device(rows, torch.long, dev)]
    width = 0
    if tree is None:  # every row greedy: the engine built no batch tree
        result = greedy_tokens(logits, rows_params, rows_ctx)  # [R]
    else:
        res = accept_on_device(engine, logits, rows_params, rows_ctx,
                               [s for s, _ in samplers], tree, local_offsets)
        width = res.tokens.shape[1]
        result = torch.cat([res.tokens.flatten(), res.num_tokens, res.accepted_nodes.flatten()])
    return PendingStep(plan, out, samplers, tree_lists, logits, local_offsets, tree is None,
                       device_to_host(result), width, launched)


def _read(p: PendingStep) -> tuple[list[list[int]], list[list[int]]]:
    """Per sampler (emitted tokens, accepted local nodes): the step's host synchronisation."""
    flat = p.result.tolist()
    if p.greedy:
        return verify_greedy_lists(flat, p.tree_lists, p.local_offsets)
    bsz, width = len(p.samplers), p.width
    num_h = flat[bsz * width:bsz * width + bsz]
    acc = flat[bsz * width + bsz:]
    new_h = [flat[b * width:b * width + num_h[b]] for b in range(bsz)]
    acc_h = [acc[b * (width - 1):b * (width - 1) + num_h[b] - 1] for b in range(bsz)]
    return new_h, acc_h


def finish_step(engine: LLMEngine, p: PendingStep) -> list[Settled]:
    """Read a launched step back: accept, commit KV, append tokens, finish what stopped.
    Returns what each sampler's output is built from (`report`)."""
    new_h, acc_h = _read(p)
    samplers, plan, out = p.samplers, p.plan, p.out
    dev = p.logits.device
    want_lp = [s.params.logprobs is not None for s, _ in samplers]
    lp_rows: list[int] = []
    lp_tokens: list[int] = []
    for b in range(len(samplers)):
        if want_lp[b]:
            lp_rows += [p.local_offsets[b]] + [p.local_offsets[b] + 1 + a for a in acc_h[b]]
            lp_tokens += new_h[b]
    lp = None
    if lp_rows:
        top_n = max(s.params.logprobs or 0 for s, _ in samplers)
        idx = torch.tensor(lp_rows, dtype=torch.long, device=dev)
        chosen, top_v, top_i = logprobs_of(p.logits[idx], torch.tensor(lp_tokens, device=dev),
                                           top_n)
        lp = (chosen.tolist(), top_v.tolist(), top_i.tolist())

    bm = engine.blocks
    num_prefills = sum(x.completes for x in plan.prefills)
    src: list[int] = []
    dst: list[int] = []
    settled: list[Settled] = []
    lp_cursor = 0
    now = time.monotonic()
    capture = capture_layers(engine, plan) if out.features is not None else None
    for b, (seq, ctx) in enumerate(samplers):
        toks, pars = p.tree_lists[b]
        new, accepted = new_h[b], acc_h[b]
        n = len(new)
        is_decode = b >= num_prefills
        if is_decode and out.features is not None and wants_features(engine, seq):
            q0 = out.query_offsets[len(plan.prefills) + b - num_prefills]
            rows = torch.tensor([q0] + [q0 + 1 + a for a in accepted], device=dev)
            engine._drafter_of(seq).observe(
                seq.request_id, ctx, [seq.last_token] + new[:len(accepted)],
                features_for(engine, out, capture, seq, rows))
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
            depth = row_shape(pars).depth
            _record(engine, seq, len(toks), len(accepted), n, depth)
        logprobs = None
        if want_lp[b] and lp is not None:
            k = seq.params.logprobs or 0
            logprobs = [TokenLogprob(t, lp[0][lp_cursor + i],
                                     dict(zip(lp[2][lp_cursor + i][:k], lp[1][lp_cursor + i][:k])))
                        for i, t in enumerate(new)]
            lp_cursor += n
        settled.append(settle_tokens(engine, seq, new, logprobs, now))
    engine.runner.move_kv(src, dst)
    return settled


def report(engine: LLMEngine, settled: list[Settled]) -> list[RequestOutput]:
    """The outputs of settled sequences (detokenizing happens here)."""
    return [engine._output(*s) for s in settled]


def settle(engine: LLMEngine, seq: Sequence, new: list[int], logprobs: list | None,
           now: float) -> RequestOutput:
    """`settle_tokens`, then the sequence's output."""
    return engine._output(*settle_tokens(engine, seq, new, logprobs, now))


def settle_tokens(engine: LLMEngine, seq: Sequence, new: list[int], logprobs: list | None,
                  now: float) -> Settled:
    """Append a sequence's new tokens (whose KV is committed), up to its first stop condition;
    finish it if one was met."""
    kept, reason = finish_check(engine, seq, new, now)
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
    return seq, kept, logprobs, reason is not None


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
    probs = process_logits(logits, rows_params, rows_ctx, engine.token_pieces)
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


def finish_check(engine: Any, seq: Sequence, new: list[int],
                 now: float | None = None) -> tuple[list[int], str | None]:
    """Cut `new` at the first stop condition. Returns (tokens to keep, finish reason); sets
    `seq.stop_reason`."""
    p = seq.params
    kept: list[int] = []
    reason = None
    for t in new:
        kept.append(t)
        n_out = len(seq.output_token_ids) + len(kept)
        if n_out >= p.min_tokens:
            if t in p.stop_token_ids:
                reason, seq.stop_reason = "stop", t
                break
            if not p.ignore_eos and t in engine._eos:
                reason = "stop"
                break
        if n_out >= p.max_tokens:
            reason = "length"
            break
    detok = engine._detok[seq.request_id]
    if p.max_predict_ms is not None and now is not None and seq.first_token_time is not None \
            and (now - seq.first_token_time) * 1e3 >= p.max_predict_ms:
        had_newline = "\n" in detok.decode_output(seq.output_token_ids)
        keep = past_budget([detok.decode_output([t]) for t in kept], had_newline, True)
        if keep is not None and (reason is None or keep < len(kept)):
            kept, reason, seq.stop_reason = kept[:keep], "length", "budget"
    if p.stop or detok.rules is not None:
        found = detok.find_stop(seq.output_token_ids + kept, final=reason is not None)
        if found is not None:
            at, why, word = found
            seq.stop_reason = word if why == "stop" else "n_indent"
            return _cut_at_stop(detok, seq, kept, at), why
    return kept, reason


def _cut_at_stop(detok: Any, seq: Sequence, kept: list[int], at: int) -> list[int]:
    """Keep the fewest tokens whose text reaches the stop offset `at` (the text from there is
    not output). The stop may begin in tokens an earlier step appended (a rule that waits for
    a line end, a stop string split over steps): those are taken back too, so the output's
    tokens are the same however steps grouped them (plain or speculative)."""
    ids = seq.output_token_ids + kept
    n = len(ids)
    while n > 0 and len(detok.decode_output(ids[:n - 1])) > at:
        n -= 1
    old = len(seq.output_token_ids)
    if n < old:
        seq.output_token_ids = seq.output_token_ids[:n]  # a new list: Sequence.tokens rebuilds
        return []
    return kept[:n - old]
