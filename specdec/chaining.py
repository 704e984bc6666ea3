"""Chained steps: step n + 1 is launched from step n's verdict on the device, before step n is
read back, so the host's bookkeeping of step n (KV commits, stop checks, detokenizing) hides
behind the device's work on step n + 1.

A step needs from the host what the verdict of the step before decides: how many tokens each
sequence emitted (so its positions and KV slots), the last one (the next root) and the next
drafts. When the drafts can be made on the device (specdec/device_drafts.py: position tables,
`Drafter.position_table`, as the replay drafter's; or prompt lookup over a device copy of the
tokens, `Drafter.has_device_lookup`, as the n-gram drafter's with `on_device`), all of that can
be had there. Plain decoding is the zero-node case: one token per step, whose positions and
slots the host knows; only the root token comes from the device.

The host stages step n + 1 as if step n had emitted nothing; queued behind step n on the same
stream, `step_inputs.advance_staged` then moves every sequence on by its emitted count, writes
the root and drafts, and maps positions to KV slots through the block tables (inside a CUDA
graph bucket's staged inputs; on the CPU the same staging and fix run, and the step runs
eagerly from them).

Which steps: plain decodes of requests that do not speculate, greedy or sampled; or greedy draft
trees of one shape for every sequence (chains included), all from drafters of one device source;
no penalties, logprobs or hidden-state capture. Adaptive requests chain while the goodput
controller holds its last choice (no probe in it, the next one not yet due) and that choice
gives every one the same depth, 0 included: a host-planned step of the same work costs its host
time on a GPU (at batch 16 an 8B-shape plain step took 9.3 ms so against 4.6 ms chained; at
batch 32 host-planned drafted steps cost 8.7-9.3 ms beyond a plain step's 5.2 ms, more than
fixed k = 4 chained cost in all). Blocks for two steps ahead are reserved before each launch.
A sequence that stops at step n has its step n + 1 work dropped; the next launch leaves it out
(its rows are gathered away), so the chain runs on as the batch shrinks. A new, aborted or
preempted request ends it, and the engine steps from the host.

Greedy acceptance on the device (verdict.accept_greedy) is the host's rule, and the accepted
path's KV moves to consecutive slots on the device (`ModelRunner.move_kv_device`), as the
commit does from host lists: output is token for token the output of plain decoding.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from drafters import DraftRequest
from drafters.tree import DraftTree
from specdec.commit import ChainState, Launched, Row
from specdec.device_drafts import LookupDrafts, TableDrafts
from specdec.sampler import argmax_rows, host_to_device
from specdec.step_inputs import (
    Draft,
    Segment,
    advance_staged,
    chained_segments,
    pick_bucket,
    staged_segments,
)
from specdec.verdict import TreeShape, Verdict, accept_greedy, accept_on_device

if TYPE_CHECKING:
    from specdec.block_manager import BlockManager
    from specdec.drafting import Drafting
    from specdec.model_runner import ModelRunner
    from specdec.request import Request
    from specdec.sampler import TokenPieces
    from specdec.scheduler import Scheduler, StepPlan
    from specdec.sequence import Sequence
    from specdec.step_inputs import StepOutput


class Chainer:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, drafting: Drafting,
                 pieces: TokenPieces, max_model_len: int) -> None:
        # Which steps chain (RuntimeConfig.overlap, .spec_overlap; LLMEngine.use_runtime).
        self.plain = self.speculative = False
        self.runner, self.blocks, self.drafting = runner, blocks, drafting
        self.pieces = pieces
        self.max_model_len = max_model_len
        self.chained_steps = 0  # steps launched before their predecessor was read back
        self._shapes: dict[tuple[int, ...], TreeShape] = {}

    # -- the first step of a chain, built by the host ---------------------------------------
    def qualifies(self, plan: StepPlan, drafts: list[Draft], reqs: list[Request],
                  capture) -> tuple[TreeShape, tuple | None] | None:
        """(shape, device draft kind) when the next step may be chained from this one."""
        if not self.plain or plan.prefills or not plan.decodes or capture is not None:
            return None
        for r in reqs:
            p = r.seq.params
            if p.has_penalties or p.logprobs is not None:
                return None
        if not any(d.tokens for d in drafts):
            if any(r.spec.on for r in reqs) and not self._resting(reqs):
                return None  # a speculating request drafts again next step: from the host
            return self._shape([]), None
        if not self.speculative or (self.runner.graphs is None
                                    and self.runner.device.type == "cuda"):
            return None
        pars0 = drafts[0].parents
        held = self.drafting.controller.holding
        kinds = set()
        for d, r in zip(drafts, reqs):
            if (not d.tokens or d.parents != pars0 or d.probs is not None
                    or not r.seq.params.greedy or (r.spec.adaptive and not held)):
                return None
            kinds.add(self.drafting.device_kind(r))
        if len(kinds) != 1 or None in kinds:
            return None
        kind = kinds.pop()
        shape = self._shape(pars0)
        if kind[0] == "lookup" and not shape.is_chain:
            return None
        return (shape, kind) if self._fits([r.seq for r in reqs], shape) else None

    def _resting(self, reqs: list[Request]) -> bool:
        """Whether every speculating request is adaptive, at the depth 0 the controller chose
        for the whole batch, with its next probe not yet due."""
        return all(not r.spec.on or (r.spec.adaptive and r.depth == 0) for r in reqs) \
            and self.drafting.controller.resting

    def first(self, out: StepOutput, segs: list[Segment], reqs: list[Request],
              shape: TreeShape, kind: tuple | None, launched_at: float) -> Launched:
        """The `Launched` of a host-built step that `qualifies`: its verdict on the device, and
        the device drafts its successors are made from."""
        dev = self.runner.device
        drafts = None
        if kind is not None:
            length = self.max_model_len + shape.rows
            if kind[0] == "lookup":
                drafts = LookupDrafts.from_tokens([r.seq.tokens for r in reqs], length,
                                                  kind[1], kind[2], dev)
            else:
                drafts = TableDrafts(self._table(reqs, shape, length))
        ids = slots = None
        if shape.parents:
            ids = host_to_device([g.tokens for g in segs], torch.long, dev)
            slots = host_to_device([g.slots for g in segs], torch.long, dev)
        rows = [Row(r, g.context_len, shape.parents) for r, g in zip(reqs, segs)]
        return Launched(rows, self._verdict(out.logits, reqs, shape, ids, slots),
                        len(segs) * shape.rows, launched_at, kv_moved=True,
                        chain=ChainState(shape, drafts))

    # -- chained steps ----------------------------------------------------------------------
    def can_chain(self, step: Launched, scheduler: Scheduler) -> bool:
        """True when the next step is `step`'s batch (less sequences that have finished), each
        with blocks reserved two steps ahead."""
        c = step.chain
        if c is None or scheduler.waiting or not scheduler.running:
            return False
        live = {id(row.req.seq) for row in step.rows}
        if any(id(s) not in live or s.aborted for s in scheduler.running):
            return False
        seqs = [row.req.seq for row in step.rows if not row.req.seq.is_finished]
        if len(seqs) != len(scheduler.running) or not self._fits(seqs, c.shape):
            return False
        if any(row.req.spec.adaptive for row in step.rows):
            # Adaptive requests at the depths the controller chose (0 included): steps chain on
            # while it holds that choice, each counted towards its next probe, which is
            # planned on the host.
            if not self.drafting.controller.hold_step():
                return False
        # A sequence that `step` ends (by length or a stop) has its successor's work dropped
        # and leaves the chain after it: no reason to stop chaining for it.
        return all(self.blocks.reserve(s, 2 * c.shape.rows) for s in seqs)

    def chain(self, prev: Launched) -> Launched:
        """Launch the step after `prev` from `prev`'s device verdict (after `can_chain` said
        yes). Its rows' contexts are `prev`'s until `prev` is committed (Launched.rebase)."""
        c = prev.chain
        assert c is not None
        shape, runner, v = c.shape, self.runner, prev.verdict
        keep = [i for i, row in enumerate(prev.rows) if not row.req.seq.is_finished]
        reqs = [prev.rows[i].req for i in keep]
        same = len(keep) == len(prev.rows)
        rows = None if same and not shape.parents else host_to_device(keep, torch.long,
                                                                        runner.device)
        launched_at = time.perf_counter()
        drafts = None
        segs = chained_segments([r.seq for r in reqs], shape, self.blocks)
        if not shape.parents:  # plain decoding: the tokens come from the device
            tokens = v.emitted[:, 0] if same else v.emitted.index_select(0, rows)[:, 0]
            out = runner.execute(segs, token_source=tokens)
            ids = slots = None
        else:
            # Queued behind `prev`; a history gains at most a step's rows from `prev`.
            bound = max(r.seq.num_tokens for r in reqs) + shape.rows
            drafts = c.drafts.next(v.emitted, v.num, rows, same, bound)
            if runner.graphs is not None:
                fixed: list[tuple[torch.Tensor, torch.Tensor]] = []

                def fix(d64, d32, lay):
                    fixed.append(advance_staged(d64, d32, lay, runner.block_size, len(segs),
                                                shape, v.emitted, v.num, rows, drafts))

                out = runner.execute(segs, fixup=fix)
                ids, slots = fixed[0]
            else:  # the CPU: the "device" is the host, and the step is built from its lists
                ids, slots, segs = staged_segments(segs, self.blocks.block_size, shape,
                                                   v.emitted, v.num, keep, drafts)
                out = runner.execute(segs)
        self.chained_steps += 1
        return Launched([Row(r, r.seq.num_computed, shape.parents) for r in reqs],
                        self._verdict(out.logits, reqs, shape, ids, slots),
                        len(reqs) * shape.rows, launched_at, kv_moved=True,
                        chain=ChainState(shape, drafts))

    # -- helpers ----------------------------------------------------------------------------
    def _verdict(self, logits: torch.Tensor, reqs: list[Request], shape: TreeShape,
                 ids: torch.Tensor | None, slots: torch.Tensor | None) -> Verdict:
        if not shape.parents:
            if all(r.seq.params.greedy for r in reqs):
                return Verdict.plain(argmax_rows(logits))
            # Sampled: the draw the host-built step makes, from each request's own uniforms.
            n = len(reqs)
            res = accept_on_device(logits, [r.seq.params for r in reqs], None, reqs,
                                   DraftTree.empty(n), list(range(n)), self.pieces)
            return Verdict.plain(res.tokens[:, 0])
        emitted, num, nodes = accept_greedy(logits, ids, shape)
        if not shape.is_chain:
            # KV of the accepted path moves to consecutive rows after the root: depth d's node
            # to row d (the commit does this from host lists for host-verified steps).
            dst = slots[:, 1:shape.k + 1]
            moved = (nodes >= 0) & (nodes != torch.arange(shape.k, device=nodes.device))
            src = torch.where(moved, slots.gather(1, 1 + nodes.clamp(min=0)), dst)
            self.runner.move_kv_device(src.flatten(), dst.flatten())
        return Verdict.of(emitted, num, nodes)

    def _shape(self, parents: list[int]) -> TreeShape:
        key = tuple(parents)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = TreeShape(parents)
        return shape

    def _fits(self, seqs: list[Sequence], shape: TreeShape) -> bool:
        """Two steps stay inside the context, and (with drafts) a graph bucket takes them."""
        m = shape.rows
        if any(s.num_tokens + 2 * m > self.max_model_len for s in seqs):
            return False
        graphs = self.runner.graphs
        if graphs is None or not shape.parents:
            return True
        probe = [Segment([0] * m, [], [], s.num_computed + m, s.block_table) for s in seqs]
        return pick_bucket(probe, graphs.width, graphs.block_size) is not None

    def _table(self, reqs: list[Request], shape: TreeShape, length: int) -> torch.Tensor:
        rows = []
        for r in reqs:
            dr = DraftRequest(request_id=r.request_id, tokens=r.seq.tokens,
                              max_nodes=shape.rows - 1, k=shape.k, options=r.spec.options,
                              params=r.seq.params)
            t = r.drafter.position_table(dr, length, self.runner.device)
            rows.append(t if t.dim() == 2 else t[:, None])
        table = torch.stack(rows)  # [n, L, W]
        if table.shape[2] < shape.width:
            raise ValueError("a position table is narrower than the tree it drafts")
        # Checked once, when the chain starts (host-built steps check each step's drafts): an
        # id past the vocabulary would index past the embedding on the device.
        if not 0 <= int(table.min()) <= int(table.max()) < self.runner.vocab_size:
            raise ValueError("a position table holds a token outside the vocabulary")
        return table
