"""Overlapped speculative decoding: step n + 1 is launched before step n's verdict is read back.

A speculative step needs from the host what the verdict of the step before decides: how many
draft tokens were accepted (so each sequence's positions and KV slots), the bonus token (the
next root) and the next drafts. When the drafter's proposals are a function of position alone
(`Drafter.position_table`: the replay drafter), all of that can be had on the device. The host
stages step n + 1 as if step n had emitted nothing (positions from the context it knows, no
tokens); queued behind step n on the same stream, `chain_inputs` then moves every sequence on
by its emitted count, writes the root and drafts, and maps positions to KV slots through the
block tables. Step n's tokens come back while step n + 1 computes, and the host's bookkeeping
(KV commits, stop checks, detokenizing, outputs) hides behind the device's work, as plain
decoding's does (specdec/overlap.py).

Which steps: greedy chains of one depth k for every sequence, all from drafters with a position
table, no penalties or logprobs, no hidden-state capture, no adaptive depth, through a CUDA graph
bucket (the staged inputs are fixed on the device in place). Blocks for two steps ahead are
reserved before each launch. A sequence that stops at step n has its step n + 1 work dropped; the
next launch leaves it out (its rows are gathered away), so the pipeline runs on as the batch
shrinks. A new, aborted or preempted request drains it, and the engine steps normally.

Greedy acceptance on the device is the host's (specdec.verifier.verify_greedy_lists): a draft
is accepted while it equals the argmax of the row before it; the argmax after the last accepted
row is the bonus token. Output is token for token the output of plain greedy decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from drafters import DraftRequest
from drafters.tree import row_shape
from specdec.model_runner import Segment
from specdec.sampler import HostCopy, argmax_rows, device_to_host, host_to_device
from specdec.step_results import _record, settle_tokens

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.graph_inputs import Layout
    from specdec.outputs import RequestOutput
    from specdec.scheduler import StepPlan
    from specdec.sequence import Sequence


@dataclass
class InFlight:
    """A launched speculative step whose verdict has not been read back."""

    seqs: list[Sequence]
    contexts: list[int]  # per sequence, its KV entries before the step (the root's position)
    table: torch.Tensor  # [n, L] the sequences' position tables (device)
    emitted: torch.Tensor  # [n, k + 1] argmax of every row (device)
    num: torch.Tensor  # [n] tokens emitted: accepted drafts + the bonus (device)
    host: HostCopy  # emitted then num, on their way to the host


def accept_chains(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a batch of chains on the device. `logits` [n * m, V], the rows of
    each sequence's root and k = m - 1 drafts in order; `ids` [n, m] the rows' input tokens.
    Returns (argmax [n, m], emitted count [n]): the first `count` argmax tokens are the
    accepted drafts then the bonus token."""
    n, m = ids.shape
    am = argmax_rows(logits).view(n, m)
    ok = (am[:, :-1] == ids[:, 1:]).to(torch.int32)
    return am, ok.cumprod(dim=1).sum(dim=1).to(torch.int64) + 1


def chain_inputs(d64: torch.Tensor, d32: torch.Tensor, lay: Layout, block_size: int,
                 n: int, k: int, prev: InFlight, rows: torch.Tensor, table: torch.Tensor
                 ) -> torch.Tensor:
    """Move a step staged from the host's stale view forward on the device, in place.

    The staging buffers (specdec.graph_inputs.Layout) hold n chains of k drafts, staged with each
    sequence's context as the host knew it when step `prev` launched (positions ctx .. ctx + k,
    no tokens). Sequence i was row rows[i] of `prev`: its context grows by that row's emitted
    count, its root is the last emitted token and its drafts come from its position table.
    Returns the step's input tokens [n, k + 1]."""
    t, b, q, w = lay.tokens, lay.batch, lay.q, lay.width
    m = k + 1
    add = prev.num.index_select(0, rows)  # [n]
    root = prev.emitted.index_select(0, rows).gather(1, (add - 1)[:, None])  # [n, 1]
    ctx = d32[b + 1:2 * b + 1][:n]
    ctx += add.to(torch.int32)
    d32[2 * b + 1:3 * b + 1][:n] += add.to(torch.int32)
    pos = d64[t:2 * t].view(b, q)[:n, :m]
    pos += add[:, None]
    # Drafts sit after the root: positions ctx + 1 .. ctx + k of the sequence.
    drafts = table.gather(1, pos[:, 1:])
    ids = torch.cat([root, drafts], dim=1)  # [n, m]
    d64[0:t].view(b, q)[:n, :m] = ids
    tables = d32[3 * b + 1:3 * b + 1 + b * w].view(b, w)[:n]
    blocks = tables.gather(1, (pos // block_size).to(torch.int64)).to(torch.int64)
    d64[2 * t:3 * t].view(b, q)[:n, :m] = blocks * block_size + pos % block_size
    return ids


class SpecPipeline:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: InFlight | None = None
        self.chained_steps = 0  # steps launched before their predecessor was read back
        self._k = 0

    def qualifies(self, engine: LLMEngine, plan: StepPlan, trees: list, capture) -> bool:
        """A step of greedy chains of one depth, from drafters with position tables, that a
        graph bucket runs."""
        graphs = engine.runner.graphs
        if plan.prefills or not plan.decodes or capture is not None:
            return False
        if graphs is None and engine.runner.device.type == "cuda":
            return False
        k = plan.decodes[0].seq.spec_k
        for d, (toks, pars, probs) in zip(plan.decodes, trees):
            s, p = d.seq, d.seq.params
            if (s.spec_method == "none" or s.spec_k != k or len(toks) != k or probs is not None
                    or pars != list(range(-1, k - 1)) or not p.greedy or p.has_penalties
                    or p.logprobs is not None
                    or s.spec_options.get("adaptive", engine.adaptive_default)
                    or not engine._drafter_of(s).has_position_table(s.spec_options)):
                return False
        if k < 1 or not self._fits(engine, [d.seq for d in plan.decodes], k):
            return False
        return True

    @staticmethod
    def _fits(engine: LLMEngine, seqs: list[Sequence], k: int) -> bool:
        """Two steps of k + 1 rows stay inside the context, and a graph bucket takes them."""
        if any(s.num_tokens + 2 * (k + 1) > engine.max_model_len for s in seqs):
            return False
        graphs = engine.runner.graphs
        if graphs is None:
            return True
        from specdec.graph_inputs import pick_bucket

        probe = [Segment([0] * (k + 1), [], [], s.num_computed + k + 1, s.block_table)
                 for s in seqs]
        return pick_bucket(probe, graphs.width, graphs.block_size) is not None

    def launch(self, engine: LLMEngine, plan: StepPlan, segs: list[Segment]) -> None:
        """Run a step whose segments the host built (its drafts from the host drafter), and keep
        its verdict in flight."""
        seqs = [d.seq for d in plan.decodes]
        k = seqs[0].spec_k
        self._k = k
        dev = engine.runner.device
        table = self._table(engine, seqs, k)
        out = engine.runner.execute(segs)
        ids = host_to_device([g.tokens for g in segs], torch.long, dev)
        self._keep(engine, seqs, [g.context_len for g in segs], table, out.logits, ids)

    def _table(self, engine: LLMEngine, seqs: list[Sequence], k: int) -> torch.Tensor:
        length = engine.max_model_len + k + 1
        rows = []
        for s in seqs:
            r = DraftRequest(request_id=s.request_id, tokens=s.tokens, max_nodes=k, k=k,
                             options=s.spec_options, params=s.params)
            rows.append(engine._drafter_of(s).position_table(r, length, engine.runner.device))
        return torch.stack(rows)

    def _keep(self, engine: LLMEngine, seqs: list[Sequence], contexts: list[int],
              table: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor) -> None:
        emitted, num = accept_chains(logits, ids)
        self.in_flight = InFlight(seqs, contexts, table, emitted, num,
                                  device_to_host(torch.cat([emitted.flatten(), num])))

    def can_chain(self, engine: LLMEngine) -> bool:
        """True when the next step is the step in flight's batch (less sequences that have
        finished), each with blocks reserved for two steps ahead."""
        f = self.in_flight
        sched = engine.scheduler
        if f is None or sched.waiting or not sched.running:
            return False
        live = {id(s) for s in f.seqs}
        if any(id(s) not in live or s.aborted for s in sched.running):
            return False
        seqs = [s for s in f.seqs if not s.is_finished]
        if len(seqs) != len(sched.running) or not self._fits(engine, seqs, self._k):
            return False
        return all(engine.blocks.reserve(s, 2 * (self._k + 1)) for s in seqs)

    def chain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Launch the next step from the device verdict of the one in flight, then read that one
        back. Call after `can_chain` said yes."""
        f = self.in_flight
        assert f is not None
        k, runner = self._k, engine.runner
        keep = [i for i, s in enumerate(f.seqs) if not s.is_finished]
        seqs = [f.seqs[i] for i in keep]
        dev = runner.device
        rows = host_to_device(keep, torch.long, dev)
        table = f.table if len(keep) == len(f.seqs) else f.table.index_select(0, rows)
        shape = row_shape(list(range(-1, k - 1)))
        segs = [Segment([0] * (k + 1), [s.num_computed + x for x in shape.offsets],
                        [-1] * (k + 1), s.num_computed, s.block_table, mask=shape.mask,
                        logits_rows=shape.logits_rows) for s in seqs]
        contexts = [s.num_computed for s in seqs]  # before `f`'s emitted tokens
        if runner.graphs is not None:
            fixed: list[torch.Tensor] = []

            def fix(d64, d32, lay):
                fixed.append(chain_inputs(d64, d32, lay, runner.block_size, len(segs), k, f,
                                          rows, table))

            out = runner.execute(segs, fixup=fix)
            ids = fixed[0]
        else:  # the CPU: the "device" is the host, and the step is built from its lists
            ids, segs = self._host_segments(engine, f, keep, segs, table)
            out = runner.execute(segs)
        self._keep(engine, seqs, contexts, table, out.logits, ids)
        self.chained_steps += 1
        outputs = self._read_back(engine, f, in_flight=k + 1)
        # The new step's contexts gain what `f` emitted: read back just now.
        self.in_flight.contexts = [s.num_computed if not s.is_finished else c
                                   for s, c in zip(seqs, contexts)]
        if all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # nothing left to read: its work is dropped
        return outputs

    @staticmethod
    def _host_segments(engine: LLMEngine, f: InFlight, keep: list[int], segs: list[Segment],
                       table: torch.Tensor) -> tuple[torch.Tensor, list[Segment]]:
        """`chain_inputs` done on host lists (for a runner without graphs, on the CPU)."""
        bm = engine.blocks
        num = f.num.tolist()
        emitted = f.emitted.tolist()
        out = []
        for i, g in zip(keep, segs):
            add = num[i]
            c = g.context_len + add
            m = len(g.tokens)
            toks = [emitted[i][add - 1]] + table[len(out), c + 1:c + m].tolist()
            seq = f.seqs[i]
            out.append(Segment(toks, [p + add for p in g.positions], bm.slots(seq, c, m), c,
                               g.block_table, mask=g.mask, logits_rows=g.logits_rows))
        ids = torch.tensor([g.tokens for g in out], dtype=torch.long, device=table.device)
        return ids, out

    def drain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Read back the step in flight, launching nothing after it."""
        f, self.in_flight = self.in_flight, None
        return [] if f is None else self._read_back(engine, f, in_flight=0)

    def _read_back(self, engine: LLMEngine, f: InFlight, in_flight: int) -> list[RequestOutput]:
        flat = f.host.tolist()  # the step's one host synchronisation
        n, m = len(f.seqs), self._k + 1
        nums = flat[n * m:]
        now = time.monotonic()
        outputs = []
        for i, (seq, ctx) in enumerate(zip(f.seqs, f.contexts)):
            if seq.is_finished:
                continue  # stopped at the step before: this step ran past its end
            new = flat[i * m:i * m + nums[i]]
            engine.blocks.commit(seq, ctx + nums[i], in_flight)
            if seq.request_id in engine._spec:
                _record(engine, seq, self._k, nums[i] - 1, nums[i], self._k)
            outputs.append(engine._output(*settle_tokens(engine, seq, new, None, now)))
        return outputs
