"""A launched step and its commit: the one place a step's verdict reaches the requests.

Every step, however it was launched (built by the host, or chained on the device from its
predecessor's verdict, specdec/chaining.py), is a `Launched` record: its rows (one per sampling
sequence: a completed prefill or a decode) and its `Verdict` (specdec/verdict.py).
`StepCommitter.commit` reads the verdict (the step's host synchronisation) and does what the
next step depends on: the accepted path's KV moved to consecutive slots and committed, target
features handed to drafters that consume them, speculation metrics, tokens appended up to the
first stop condition, drafters told, finished requests removed from the scheduler. Building
the outputs (detokenizing) is left to the engine, after the next pass is launched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from drafters.tree import row_shape
from specdec.outputs import TokenLogprob
from specdec.request import Request
from specdec.sampler import logprobs_of
from specdec.verdict import TreeShape, Verdict

if TYPE_CHECKING:
    from specdec.block_manager import BlockManager
    from specdec.device_drafts import LookupDrafts, TableDrafts
    from specdec.drafting import Drafting
    from specdec.model_runner import ModelRunner
    from specdec.output_builder import OutputBuilder
    from specdec.scheduler import Scheduler

log = logging.getLogger("specdec.engine")

# (request, its new tokens, their logprobs or None, finished): what an output is built from.
Settled = tuple[Request, list[int], Any, bool]


@dataclass
class ChainState:
    """What a chained successor of a step is made from (specdec/chaining.py)."""

    shape: TreeShape  # every row's tree ([] parents: plain decoding)
    drafts: TableDrafts | LookupDrafts | None  # the device drafts; None for plain decoding


@dataclass(slots=True)
class Row:
    """One sampling sequence of a launched step."""

    req: Request
    context: int  # KV entries before the step: the root's position
    parents: list[int]  # its draft tree's shape ([]: a plain decode or a completed prefill)
    decode: bool = True  # False: a completed prefill (the row of its last chunk's last token)
    query_row: int = 0  # its root's query row in the pass (target features)


@dataclass
class Launched:
    rows: list[Row]
    verdict: Verdict
    num_tokens: int  # query rows of the pass
    launched_at: float  # time.perf_counter() at launch
    logits: torch.Tensor | None = None  # [R, V] raw, the verdict's rows (logprobs read them)
    root_rows: list[int] = field(default_factory=list)  # per row, its root's row in `logits`
    features: torch.Tensor | None = None  # target features the pass captured (EAGLE)
    capture: tuple[int, ...] | None = None  # ... of these layers
    kv_moved: bool = False  # the accepted paths' KV was compacted on the device
    chain: ChainState | None = None  # set when the next step may be chained from this one

    def rebase(self) -> Launched | None:
        """After the predecessor of a chained step is committed: each row's context is what
        that commit left (the host staged the step before knowing it). None when every row
        has finished since (the step's work is dropped)."""
        live = False
        for row in self.rows:
            if not row.req.seq.is_finished:
                row.context = row.req.seq.num_computed
                live = True
        return self if live else None


class StepCommitter:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, scheduler: Scheduler,
                 drafting: Drafting, outputs: OutputBuilder, max_model_len: int) -> None:
        self.runner, self.blocks, self.scheduler = runner, blocks, scheduler
        self.drafting, self.outputs = drafting, outputs
        self.max_model_len = max_model_len

    def commit(self, step: Launched, in_flight: int = 0) -> list[Settled]:
        """Read `step` back and settle its rows. `in_flight`: KV slots per sequence that a
        step launched after this one writes (their blocks are kept)."""
        new_h, acc_h = step.verdict.read()
        lp = self._logprobs(step, new_h, acc_h)
        src: list[int] = []
        dst: list[int] = []
        settled: list[Settled] = []
        now = time.monotonic()
        for b, row in enumerate(step.rows):
            if row.req.seq.is_finished:
                continue  # stopped at the step before: this step ran past its end
            try:
                settled.append(self._commit_row(step, row, new_h[b], acc_h[b], lp.get(b),
                                                in_flight, now, src, dst))
            except Exception as exc:  # a drafter's or a stop rule's: this request's alone
                log.exception("committing %s failed", row.req.request_id)
                row.req.fail(f"engine error: {exc}")
        self.runner.move_kv(src, dst)
        return settled

    def _commit_row(self, step: Launched, row: Row, new: list[int], accepted: list[int],
                    logprobs: list | None, in_flight: int, now: float, src: list[int],
                    dst: list[int]) -> Settled:
        """Settle one row; the KV moves its accepted path needs are appended to src, dst."""
        r, seq = row.req, row.req.seq
        if not row.decode:
            self.blocks.commit(seq, seq.num_tokens)  # a completed prefill: all have KV
        else:
            if step.features is not None and self.drafting.wants_features(r):
                self.drafting.observe_verified(
                    r, row.context, [seq.last_token] + new[:len(accepted)], step.features,
                    step.capture, row.query_row, accepted)
            if not step.kv_moved:
                # KV of the accepted path moves to consecutive positions after the root.
                for j, a in enumerate(accepted):
                    if a != j:
                        src.append(self.blocks.slot(seq, row.context + 1 + a))
                        dst.append(self.blocks.slot(seq, row.context + 1 + j))
            self.blocks.commit(seq, row.context + len(new), in_flight)
            if r.metrics is not None:
                self._record(r, row.parents, len(accepted))
        return self.settle(r, new, logprobs, now)

    def settle(self, r: Request, new: list[int], logprobs: list | None, now: float) -> Settled:
        """Append r's new tokens (whose KV is committed) up to its first stop condition; finish
        it if one was met."""
        seq = r.seq
        kept, reason = self.outputs.stop_check(r, new, now)
        if logprobs is not None:
            logprobs = logprobs[:len(kept)]
        seq.output_token_ids += kept
        if seq.first_token_time is None:
            seq.first_token_time = now
        if reason is None:
            if r.drafter is not None:
                self.drafting.accepted(r, kept)
            if seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            self.drafting.release(r)
        return r, kept, logprobs, reason is not None

    def _record(self, r: Request, parents: list[int], accepted: int) -> None:
        """Speculation metrics of one verified decode. Drafts past what the request may still
        generate count as not drafted (the scheduler does not draft them on the host; a
        chained step's device drafts have its whole shape)."""
        seq = r.seq
        out = len(seq.output_token_ids)
        cap = min(seq.params.max_tokens - out - 1, self.max_model_len - out - len(
            seq.prompt_token_ids))
        depth = row_shape(parents).depth if parents else 0
        if cap < len(parents):
            cap = max(0, cap)
            accepted, depth, parents = min(accepted, cap), min(depth, cap), parents[:cap]
        self.drafting.record(r, len(parents), accepted, accepted + 1, depth)

    @staticmethod
    def _logprobs(step: Launched, new_h: list[list[int]], acc_h: list[list[int]]
                  ) -> dict[int, list[TokenLogprob]]:
        """Per row that asked for logprobs (by index), its emitted tokens' logprobs."""
        want = [b for b, row in enumerate(step.rows) if row.req.seq.params.logprobs is not None]
        if not want or step.logits is None:
            return {}
        rows: list[int] = []
        tokens: list[int] = []
        for b in want:
            r0 = step.root_rows[b]
            rows += [r0] + [r0 + 1 + a for a in acc_h[b]]
            tokens += new_h[b]
        top_n = max(step.rows[b].req.seq.params.logprobs or 0 for b in want)
        dev = step.logits.device
        chosen, top_v, top_i = logprobs_of(
            step.logits[torch.tensor(rows, dtype=torch.long, device=dev)],
            torch.tensor(tokens, device=dev), top_n)
        chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
        out, at = {}, 0
        for b in want:
            k = step.rows[b].req.seq.params.logprobs or 0
            out[b] = [TokenLogprob(t, chosen[at + i], dict(zip(top_i[at + i][:k],
                                                                top_v[at + i][:k])))
                      for i, t in enumerate(new_h[b])]
            at += len(new_h[b])
        return out
