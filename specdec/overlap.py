"""Overlapped plain decoding: step n + 1 is launched before step n's tokens are read back.

A step of plain decodes needs nothing from the host that the device does not already hold: its
input tokens are the previous step's samples (argmax, or the verifier's draw from the request's
own uniform, as without overlap), still on the device, and its positions and KV slots follow
from the previous step's. So while the GPU runs step n, the engine launches
step n + 1 with those device tokens, then waits for step n's tokens and does its bookkeeping
(KV commit, stop checks, detokenizing, outputs) while step n + 1 runs: the host's per-step work
hides behind the GPU's instead of adding to it.

The pipeline holds while the batch stays the same: no new, aborted or preempted request, and
every request decoding plainly (no speculation) without penalties or logprobs. Anything else drains
it (the step in flight is read back) and the engine steps normally. When a request stops at
step n (a stop token or string), the work step n + 1 did for it is dropped; its KV write lands
in a block that is freed only after that write is queued, so later steps, queued behind it on
the same stream, never see it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from drafters.tree import DraftTree
from specdec.model_runner import Segment
from specdec.sampler import HostCopy, argmax_rows, device_to_host
from specdec.step_results import accept_on_device, settle

if TYPE_CHECKING:
    from specdec.engine import LLMEngine
    from specdec.outputs import RequestOutput
    from specdec.scheduler import StepPlan
    from specdec.sequence import Sequence


@dataclass
class InFlight:
    """A launched plain decode step whose tokens have not been read back."""

    seqs: list[Sequence]
    contexts: list[int]  # per sequence, the KV entries present before the step
    tokens: torch.Tensor  # [B] int64, each row's sample, on the model's device
    host: HostCopy  # the copy the host reads


class DecodePipeline:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: InFlight | None = None
        self.chained_steps = 0  # steps launched before their predecessor was read back

    @staticmethod
    def qualifies(plan: StepPlan, trees: list, capture: Any) -> bool:
        """A step whose tokens the next step may take from the device: plain decodes."""
        if plan.prefills or not plan.decodes or capture is not None:
            return False
        for d, (toks, _, _) in zip(plan.decodes, trees):
            p = d.seq.params
            if toks or d.seq.spec_method != "none" or p.has_penalties or p.logprobs is not None:
                return False
        return True

    def launch(self, engine: LLMEngine, seqs: list[Sequence], segments: list[Segment],
               prev_tokens: torch.Tensor | None = None) -> None:
        """Run a step of one-row segments (one per sequence), keep its samples in flight."""
        out = engine.runner.execute(segments, token_source=prev_tokens)
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = argmax_rows(out.logits)  # [B]
        else:  # the same draw the step would make without overlap
            tokens = accept_on_device(engine, out.logits, params, None, seqs,
                                      DraftTree.empty(len(seqs)),
                                      list(range(len(seqs)))).tokens[:, 0]
        self.in_flight = InFlight(seqs, [g.context_len for g in segments], tokens,
                                  device_to_host(tokens))

    def can_chain(self, engine: LLMEngine) -> bool:
        """True when the next step is the step in flight's batch, one token on, and every
        sequence has the KV blocks for it (reserved here)."""
        f = self.in_flight
        sched = engine.scheduler
        if f is None or sched.waiting or len(sched.running) != len(f.seqs):
            return False
        for s, t in zip(sched.running, f.seqs):
            if s is not t or s.aborted:
                return False
            # One token comes back from the step in flight; chain only if it cannot be the last
            # by length (a stop token may still end it: that step's work is then dropped).
            if (len(s.output_token_ids) + 1 >= s.params.max_tokens
                    or s.num_tokens + 1 >= engine.max_model_len):
                return False
        return all(engine.blocks.reserve(s, 2) for s in f.seqs)

    def chain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Launch the next step from the device tokens of the one in flight, then read that
        one back. Call after `can_chain` said yes."""
        f = self.in_flight
        assert f is not None
        bm = engine.blocks
        segments = []
        for s in f.seqs:
            c = s.num_computed + 1  # the step in flight writes num_computed's KV
            segments.append(Segment([0], [c], [bm.slot(s, c)], c, s.block_table,
                                    logits_rows=(0,)))
        self.launch(engine, list(f.seqs), segments, prev_tokens=f.tokens)
        self.chained_steps += 1
        outputs = self._read_back(engine, f, in_flight=1)
        if all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None  # nothing left to read: its work is dropped
        return outputs

    def drain(self, engine: LLMEngine) -> list[RequestOutput]:
        """Read back the step in flight, launching nothing after it."""
        f, self.in_flight = self.in_flight, None
        return [] if f is None else self._read_back(engine, f, in_flight=0)

    @staticmethod
    def _read_back(engine: LLMEngine, f: InFlight, in_flight: int) -> list[RequestOutput]:
        tokens = f.host.tolist()  # the step's one host synchronisation
        now = time.monotonic()
        outputs = []
        for seq, ctx, t in zip(f.seqs, f.contexts, tokens):
            if seq.is_finished:
                continue  # stopped at the step before: this token was computed past its end
            engine.blocks.commit(seq, ctx + 1, in_flight)
            outputs.append(settle(engine, seq, [t], None, now))
        return outputs
