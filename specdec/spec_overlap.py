"""Overlapped speculative decoding: step n + 1 is launched before step n's verdict is read back.

A speculative step needs from the host what the verdict of the step before decides: how many
draft tokens were accepted (so each sequence's positions and KV slots), the bonus token (the
next root) and the next drafts. When the drafter's proposals can be made on the device
(specdec/device_drafts.py: a function of position alone, `Drafter.position_table`, as the
replay drafter's; or prompt lookup over a device copy of the tokens, `Drafter.has_device_lookup`,
as the n-gram drafter's with `on_device`), all of that can be had on the device. The host
stages step n + 1 as if step n had emitted nothing (positions from the context it knows, no
tokens); queued behind step n on the same stream, `chain_inputs` then moves every sequence on
by its emitted count, writes the root and drafts, and maps positions to KV slots through the
block tables. Step n's tokens come back while step n + 1 computes, and the host's bookkeeping
(KV commits, stop checks, detokenizing, outputs) hides behind the device's work, as plain
decoding's does (specdec/overlap.py).

Which steps: greedy draft trees of one shape for every sequence (chains included), all from
drafters of one device source, no penalties or logprobs, no hidden-state capture, no adaptive
depth, through a CUDA graph bucket (the staged inputs are fixed on the device in place; on the
CPU the same staging and fix run, and the step runs eagerly from them). Blocks for two steps
ahead are reserved before each launch. A sequence that stops at step n has its step n + 1 work
dropped; the next launch leaves it out (its rows are gathered away), so the pipeline runs on as
the batch shrinks. A new, aborted or preempted request drains it, and the engine steps normally.

Greedy acceptance on the device is the host's (specdec.verifier.verify_greedy_lists): a node is
accepted when it equals the argmax of its parent's row and its parent is accepted; the argmax
after the last accepted node is the bonus token. The accepted path's KV then moves to
consecutive slots on the device (`ModelRunner.move_kv_device`), as `finish_step` does from host
lists. Output is token for token the output of plain greedy decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from drafters import DraftRequest
from drafters.tree import row_shape
from specdec.device_drafts import LookupDrafts, TableDrafts
from specdec.graph_inputs import pack_step
from specdec.model_runner import Segment
from specdec.sampler import HostCopy, argmax_rows, device_to_host, host_to_device
from specdec.step_results import _record, settle

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.graph_inputs import Layout
    from specdec.outputs import RequestOutput
    from specdec.scheduler import StepPlan
    from specdec.sequence import Sequence


class TreeShape:
    """The one draft-tree shape every sequence of an overlapped step has (static while the
    pipeline runs): which row is each node's parent, the nodes of each depth, and each node's
    rank among its siblings (its column in the position tables)."""

    def __init__(self, parents: list[int]) -> None:
        self.parents = list(parents)
        n = len(parents)
        self.depth: list[int] = []
        self.column: list[int] = []
        seen: dict[int, int] = {}
        for p in parents:
            self.depth.append(1 if p < 0 else self.depth[p] + 1)
            self.column.append(seen.get(p, 0))
            seen[p] = self.column[-1] + 1
        self.k = max(self.depth, default=0)
        self.rows = n + 1
        self.width = max(self.column, default=0) + 1
        self.is_chain = parents == list(range(-1, n - 1))
        self.levels = [[i for i in range(n) if self.depth[i] == d] for d in range(1, self.k + 1)]
        self._dev: dict[torch.device, tuple] = {}

    def tensors(self, device: torch.device):
        """(parent row per node [N], column per node [N], per depth its nodes and their parent
        nodes, rows 0 .. m - 1) on `device`."""
        t = self._dev.get(device)
        if t is None:
            prow = torch.tensor([1 + p for p in self.parents], dtype=torch.long)
            col = torch.tensor(self.column, dtype=torch.long)
            levels = [(torch.tensor(lv, dtype=torch.long),
                       torch.tensor([self.parents[i] for i in lv], dtype=torch.long))
                      for lv in self.levels]
            t = self._dev[device] = (
                prow.to(device), col.to(device),
                [(a.to(device), b.to(device)) for a, b in levels],
                torch.arange(self.rows, device=device))
        return t


@dataclass
class InFlight:
    """A launched speculative step whose verdict has not been read back."""

    seqs: list[Sequence]
    contexts: list[int]  # per sequence, its KV entries before the step (the root's position)
    source: TableDrafts | LookupDrafts  # where the sequences' drafts come from on the device
    emitted: torch.Tensor  # [n, k + 1] accepted tokens then the bonus, per sequence (device)
    num: torch.Tensor  # [n] tokens emitted: accepted drafts + the bonus (device)
    host: HostCopy | None  # emitted then num, on their way to the host


def accept_greedy(logits: torch.Tensor, ids: torch.Tensor, shape: TreeShape
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a batch of same-shaped trees on the device. `logits` [n * m, V],
    each sequence's root row then its nodes' rows; `ids` [n, m] the rows' input tokens.
    A node is accepted when its token is the argmax of its parent's row and its parent is
    accepted (siblings hold distinct tokens, so at most one per depth is). Returns (emitted
    [n, k + 1], count [n], accepted node per depth [n, k], -1 past the path): the first `count`
    emitted tokens are the accepted path's then the bonus token."""
    n, m = ids.shape
    prow, _, levels, _ = shape.tensors(ids.device)
    am = argmax_rows(logits).view(n, m)
    acc = ids[:, 1:] == am.index_select(1, prow)  # [n, N]: matches its parent's argmax
    if shape.is_chain:
        acc = acc.to(torch.int32).cumprod(dim=1).bool()
    else:
        for nodes, pars in levels[1:]:
            acc[:, nodes] &= acc[:, pars]
    nodes = torch.stack([(acc[:, lv].long() * (lv + 1)).sum(dim=1) - 1 for lv, _ in levels],
                        dim=1)  # [n, k]
    count = (nodes >= 0).sum(dim=1) + 1
    path = torch.cat([torch.zeros_like(count)[:, None], 1 + nodes.clamp(min=0)], dim=1)
    return am.gather(1, path), count, nodes


def chain_inputs(d64: torch.Tensor, d32: torch.Tensor, lay: Layout, block_size: int,
                 n: int, shape: TreeShape, prev: InFlight, rows: torch.Tensor,
                 source: TableDrafts | LookupDrafts) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a step staged from the host's stale view forward on the device, in place.

    The staging buffers (specdec.graph_inputs.Layout) hold n trees of `shape`, staged with
    each sequence's context as the host knew it when step `prev` launched (no tokens, no
    slots). Sequence i was row rows[i] of `prev`: its context and positions grow by that
    row's emitted count, its root is the last emitted token, its nodes' tokens come from
    `source` (already moved past `prev`) and row r's KV slot is context + r's, through the block
    table. Returns the step's (input tokens, KV slots), each [n, m]."""
    t, b, q, w = lay.tokens, lay.batch, lay.q, lay.width
    m = shape.rows
    ar = shape.tensors(d64.device)[3]
    add = prev.num.index_select(0, rows)  # [n]
    root = prev.emitted.index_select(0, rows).gather(1, (add - 1)[:, None])  # [n, 1]
    ctx = d32[b + 1:2 * b + 1][:n]
    ctx += add.to(torch.int32)
    d32[2 * b + 1:3 * b + 1][:n] += add.to(torch.int32)
    pos = d64[t:2 * t].view(b, q)[:n, :m]
    pos += add[:, None]
    ids = torch.cat([root, source.drafts(pos[:, 1:], shape)], dim=1)  # [n, m]
    d64[0:t].view(b, q)[:n, :m] = ids
    at = ctx.to(torch.int64)[:, None] + ar  # [n, m] the rows' KV indices
    tables = d32[3 * b + 1:3 * b + 1 + b * w].view(b, w)[:n]
    blocks = tables.gather(1, at // block_size).to(torch.int64)
    slots = blocks * block_size + at % block_size
    d64[2 * t:3 * t].view(b, q)[:n, :m] = slots
    return ids, slots


class SpecPipeline:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: InFlight | None = None
        self.chained_steps = 0  # steps launched before their predecessor was read back
        self.shape: TreeShape | None = None
        self._shapes: dict[tuple[int, ...], TreeShape] = {}

    def qualifies(self, engine: LLMEngine, plan: StepPlan, trees: list, capture) -> bool:
        """A step of greedy trees of one shape, from drafters of one device source, that a
        graph bucket runs."""
        if plan.prefills or not plan.decodes or capture is not None:
            return False
        if engine.runner.graphs is None and engine.runner.device.type == "cuda":
            return False
        pars0 = trees[0][1]
        kinds = set()
        for d, (toks, pars, probs) in zip(plan.decodes, trees):
            s, p = d.seq, d.seq.params
            if (not toks or pars != pars0 or probs is not None or not p.greedy
                    or p.has_penalties or p.logprobs is not None
                    or s.spec_options.get("adaptive", engine.adaptive_default)):
                return False
            kinds.add(self._kind(engine, s))
        if len(kinds) != 1 or None in kinds:
            return False
        kind = kinds.pop()
        shape = self._shape(pars0)
        if kind[0] == "lookup" and not shape.is_chain:
            return False
        return self._fits(engine, [d.seq for d in plan.decodes], shape)

    @staticmethod
    def _kind(engine: LLMEngine, seq: Sequence) -> tuple | None:
        """How the device drafts for `seq`: ("table",), ("lookup", min_n, max_n) or None."""
        drafter, opts = engine._drafter_of(seq), seq.spec_options
        if drafter.has_position_table(opts):
            return ("table",)
        if drafter.has_device_lookup(opts):
            return ("lookup", int(opts.get("min_n", 1)), int(opts.get("max_n", 3)))
        return None

    def _shape(self, parents: list[int]) -> TreeShape:
        key = tuple(parents)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = TreeShape(parents)
        return shape

    @staticmethod
    def _fits(engine: LLMEngine, seqs: list[Sequence], shape: TreeShape) -> bool:
        """Two steps stay inside the context, and a graph bucket takes them."""
        m = shape.rows
        if any(s.num_tokens + 2 * m > engine.max_model_len for s in seqs):
            return False
        graphs = engine.runner.graphs
        if graphs is None:
            return True
        from specdec.graph_inputs import pick_bucket

        probe = [Segment([0] * m, [], [], s.num_computed + m, s.block_table) for s in seqs]
        return pick_bucket(probe, graphs.width, graphs.block_size) is not None

    def launch(self, engine: LLMEngine, plan: StepPlan, segs: list[Segment],
               parents: list[int]) -> None:
        """Run a step whose segments the host built (its drafts from the host drafter), and keep
        its verdict in flight."""
        seqs = [d.seq for d in plan.decodes]
        self.shape = self._shape(parents)
        dev = engine.runner.device
        kind = self._kind(engine, seqs[0])
        length = engine.max_model_len + self.shape.rows
        if kind[0] == "lookup":
            source = LookupDrafts.from_tokens([s.tokens for s in seqs], length, kind[1],
                                              kind[2], dev)
        else:
            source = TableDrafts(self._table(engine, seqs, length))
        out = engine.runner.execute(segs)
        ids = host_to_device([g.tokens for g in segs], torch.long, dev)
        slots = host_to_device([g.slots for g in segs], torch.long, dev)
        self._keep(engine, seqs, [g.context_len for g in segs], source, out.logits, ids, slots)

    def _table(self, engine: LLMEngine, seqs: list[Sequence], length: int) -> torch.Tensor:
        shape = self.shape
        rows = []
        for s in seqs:
            r = DraftRequest(request_id=s.request_id, tokens=s.tokens, max_nodes=shape.rows - 1,
                             k=shape.k, options=s.spec_options, params=s.params)
            t = engine._drafter_of(s).position_table(r, length, engine.runner.device)
            rows.append(t if t.dim() == 2 else t[:, None])
        table = torch.stack(rows)  # [n, L, W]
        if table.shape[2] < shape.width:
            raise ValueError("a position table is narrower than the tree it drafts")
        # Checked once, when the pipeline starts (the host path checks each step's drafts):
        # an id past the vocabulary would index past the embedding on the device.
        if not 0 <= int(table.min()) <= int(table.max()) < engine.runner.vocab_size:
            raise ValueError("a position table holds a token outside the vocabulary")
        return table

    def _keep(self, engine: LLMEngine, seqs: list[Sequence], contexts: list[int],
              source: TableDrafts | LookupDrafts, logits: torch.Tensor, ids: torch.Tensor,
              slots: torch.Tensor) -> None:
        shape = self.shape
        emitted, num, nodes = accept_greedy(logits, ids, shape)
        if not shape.is_chain:
            # KV of the accepted path moves to consecutive rows after the root: depth d's node
            # to row d (step_results.finish_step does this from host lists).
            dst = slots[:, 1:shape.k + 1]
            moved = (nodes >= 0) & (nodes != torch.arange(shape.k, device=nodes.device))
            src = torch.where(moved, slots.gather(1, 1 + nodes.clamp(min=0)), dst)
            engine.runner.move_kv_device(src.flatten(), dst.flatten())
        self.in_flight = InFlight(seqs, contexts, source, emitted, num,
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
        if len(seqs) != len(sched.running) or not self._fits(engine, seqs, self.shape):
            return False
        return all(engine.blocks.reserve(s, 2 * self.shape.rows) for s in seqs)

    def chain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Launch the next step from the device verdict of the one in flight, then read that one
        back. Call after `can_chain` said yes."""
        f = self.in_flight
        assert f is not None and self.shape is not None
        shape, runner = self.shape, engine.runner
        keep = [i for i, s in enumerate(f.seqs) if not s.is_finished]
        seqs = [f.seqs[i] for i in keep]
        dev = runner.device
        rows = host_to_device(keep, torch.long, dev)
        # Queued behind step `f`; a history gains at most a step's rows from `f`.
        bound = max(s.num_tokens for s in seqs) + shape.rows
        source = f.source.next(f, rows, len(keep) == len(f.seqs), bound)
        rs = row_shape(shape.parents)
        m = shape.rows
        segs = [Segment([0] * m, [s.num_computed + x for x in rs.offsets], [-1] * m,
                        s.num_computed, s.block_table, mask=rs.mask,
                        logits_rows=rs.logits_rows) for s in seqs]
        contexts = [s.num_computed for s in seqs]  # before `f`'s emitted tokens
        if runner.graphs is not None:
            fixed: list[tuple[torch.Tensor, torch.Tensor]] = []

            def fix(d64, d32, lay):
                fixed.append(chain_inputs(d64, d32, lay, runner.block_size, len(segs), shape,
                                          f, rows, source))

            out = runner.execute(segs, fixup=fix)
            ids, slots = fixed[0]
        else:  # the CPU: the "device" is the host, and the step is built from its lists
            ids, slots, segs = self._host_segments(engine, f, keep, segs, source)
            out = runner.execute(segs)
        self._keep(engine, seqs, contexts, source, out.logits, ids, slots)
        self.chained_steps += 1
        outputs = self._read_back(engine, f, in_flight=m)
        # The new step's contexts gain what `f` emitted: read back just now.
        self.in_flight.contexts = [s.num_computed if not s.is_finished else c
                                   for s, c in zip(seqs, contexts)]
        if all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # nothing left to read: its work is dropped
        return outputs

    def _host_segments(self, engine: LLMEngine, f: InFlight, keep: list[int],
                       segs: list[Segment], source: TableDrafts | LookupDrafts):
        """For a runner without graphs (the CPU): the step staged in a graph bucket's layout and
        moved on by `chain_inputs`, as on the GPU, then read out as segments."""
        from specdec.graph_inputs import BATCH_SIZES, TOKENS_PER_SEQ, Layout

        shape, n, m = self.shape, len(segs), self.shape.rows
        width = max(len(g.block_table) for g in segs)
        lay = Layout(next((x for x in BATCH_SIZES if x >= n), n),
                     next((x for x in TOKENS_PER_SEQ if x >= m), m), width)
        h64, h32 = np.zeros(lay.n64, np.int64), np.zeros(lay.n32, np.int32)
        pack_step(segs, lay, h64, h32, np.zeros(max(1, lay.nmask), bool))
        d64, d32 = torch.from_numpy(h64), torch.from_numpy(h32)
        rows = torch.tensor(keep, dtype=torch.long)
        ids, slots = chain_inputs(d64, d32, lay, engine.blocks.block_size, n, shape, f, rows,
                                  source)
        pos = d64[lay.tokens:2 * lay.tokens].view(lay.batch, lay.q)[:n, :m].tolist()
        ctx = d32[lay.batch + 1:lay.batch + 1 + n].tolist()
        out = [Segment(t, p, sl, c, g.block_table, mask=g.mask, logits_rows=g.logits_rows)
               for t, p, sl, c, g in zip(ids.tolist(), pos, slots.tolist(), ctx, segs)]
        return ids, slots, out

    def drain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Read back the step in flight, launching nothing after it."""
        f, self.in_flight = self.in_flight, None
        return [] if f is None else self._read_back(engine, f, in_flight=0)

    def _read_back(self, engine: LLMEngine, f: InFlight, in_flight: int) -> list[RequestOutput]:
        flat = f.host.tolist()  # the step's one host synchronisation
        shape = self.shape
        n, w = len(f.seqs), shape.k + 1
        nums = flat[n * w:]
        now = time.monotonic()
        outputs = []
        for i, (seq, ctx) in enumerate(zip(f.seqs, f.contexts)):
            if seq.is_finished:
                continue  # stopped at the step before: this step ran past its end
            new = flat[i * w:i * w + nums[i]]
            engine.blocks.commit(seq, ctx + nums[i], in_flight)
            if seq.request_id in engine._spec:
                # Counted as the host path counts: drafts past what the request may still
                # generate (the scheduler's _draft_room) are not drafted there.
                room = min(seq.params.max_tokens - len(seq.output_token_ids) - 1,
                           engine.max_model_len - seq.num_tokens)
                cap = max(0, room)
                acc = min(nums[i] - 1, cap)
                _record(engine, seq, min(shape.rows - 1, cap), acc, acc + 1, min(shape.k, cap))
            outputs.append(settle(engine, seq, new, None, now))
        return outputs
