"""Iteration-level continuous batching: plans each engine step. Ints and lists only.

Every step the scheduler (1) gives each running decode sequence one slot for its last token
plus room for a draft tree, shrinking speculation when the step's token budget is tight and
preempting the most recently arrived sequence (by recomputation) when blocks run out;
(2) continues chunked prefills and admits waiting requests, shortest remaining first, the
oldest of them always moving on.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from specdec.block_manager import BlockManager
from specdec.config import SchedulerConfig
from specdec.sequence import SeqStatus, Sequence


@dataclass
class ScheduledPrefill:
    seq: Sequence
    num_tokens: int  # chunk length: tokens num_computed .. num_computed + num_tokens - 1

    @property
    def completes(self) -> bool:
        """This chunk reaches the sequence's last token, so the step samples after it."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class ScheduledDecode:
    seq: Sequence
    max_draft_nodes: int  # 0: plain decode; else the largest tree this step may verify


@dataclass
class StepPlan:
    prefills: list[ScheduledPrefill] = field(default_factory=list)
    decodes: list[ScheduledDecode] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return (sum(p.num_tokens for p in self.prefills)
                + sum(1 + d.max_draft_nodes for d in self.decodes))


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.held: list[Sequence] = []  # set aside by `run_only`, blocks kept, not scheduled

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def run_only(self, request_ids: set[str] | None) -> None:
        """Schedule only these requests until the next call; None: all of them again. The others
        keep their place and their blocks (specdec/isolation.py runs suspects apart)."""
        for seq in self.held:
            (self.running if seq.status is SeqStatus.RUNNING else self.waiting).append(seq)
        self.held = []
        self.running.sort(key=lambda q: q.arrival_time)
        self.waiting = deque(sorted(self.waiting, key=lambda q: q.arrival_time))
        if request_ids is None:
            return
        self.held = [q for q in (*self.running, *self.waiting) if q.request_id not in request_ids]
        gone = {id(q) for q in self.held}
        self.running = [q for q in self.running if id(q) not in gone]
        self.waiting = deque(q for q in self.waiting if id(q) not in gone)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        seq.status = SeqStatus.FINISHED
        self.blocks.free_seq(seq)
        for queue in (self.running, self.waiting, self.held):
            if seq in queue:
                queue.remove(seq)
                break

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.blocks.free_seq(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _draft_room(self, seq: Sequence, wanted: int) -> int:
        # Never draft past the context limit or past what the request may still generate.
        room = self.max_model_len - seq.num_tokens
        left = seq.params.max_tokens - len(seq.output_token_ids) - 1
        return max(0, min(wanted, room, left))

    def schedule(self, draft_nodes: dict[str, int] | None = None) -> StepPlan:
        """Plan one step. `draft_nodes[request_id]` is the tree size a sequence asks for."""
        draft_nodes = draft_nodes or {}
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for s in self.running:
            (prefilling if s.in_prefill else decoding).append(s)

        # 1. Decodes. Speculation shares what is left of the budget after one token each, so
        #    it shrinks (down to plain decoding) as the batch grows.
        spare = max(0, budget - len(decoding))
        wanted = {s.request_id: (self._draft_room(s, draft_nodes[s.request_id])
                                 if s.request_id in draft_nodes else 0) for s in decoding}
        total_wanted = sum(wanted.values())
        scale = 1.0 if total_wanted <= spare else spare / total_wanted
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below, by an earlier sequence
            nodes = int(wanted[seq.request_id] * scale)
            while not self.blocks.reserve(seq, 1 + nodes):
                if nodes > 0:
                    nodes = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                plan.decodes.append(ScheduledDecode(seq, nodes))
                budget -= 1 + nodes

        # 2. Prefills and admissions, shortest remaining first: a short prompt gets its first
        #    token within a few steps however many long prompts run or wait ahead of it. The
        #    oldest of them, running or waiting, keeps half of the budget, so it moves on
        #    however many shorter prompts arrive (and with it every long one, in turn).
        cands = [s for s in prefilling if s.status is SeqStatus.RUNNING] + list(self.waiting)
        if not cands:
            return plan
        oldest = min(cands, key=lambda q: q.arrival_time)
        others = sorted((q for q in cands if q is not oldest),
                        key=lambda q: (q.num_uncomputed, q.arrival_time))
        floor = budget // 2 if others else 0
        budget = self._prefill_in_order(others, budget - floor, plan) + floor
        budget = self._prefill_in_order([oldest], budget, plan)
        self._prefill_in_order(others, budget, plan)  # what the oldest left
        return plan

    def _prefill_in_order(self, seqs: list[Sequence], budget: int, plan: StepPlan) -> int:
        """A prefill chunk for each of `seqs` not yet in the plan, in order, admitting waiting
        ones, while the budget lasts. Returns the budget left."""
        planned = {id(p.seq) for p in plan.prefills}
        admitting = True
        for seq in seqs:
            if budget <= 0:
                break
            if id(seq) in planned:
                continue
            if seq.status is SeqStatus.RUNNING:
                budget = self._schedule_prefill(seq, budget, plan)
            elif admitting and seq.status is SeqStatus.WAITING and seq in self.waiting:
                left = self._admit(seq, budget, plan)
                admitting = left is not None  # no room for it: none after it is admitted
                budget = budget if left is None else left
        return budget

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> int | None:
        """Move a waiting request to running with a first prefill chunk, if the sequence limit
        and the KV cache allow (None if not). Returns the budget left."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        if not seq.block_table:
            self.blocks.allocate_prefix(seq)
        chunk = min(seq.num_uncomputed, budget)
        if not self.blocks.can_reserve(seq, chunk):
            if not self.running:
                # Nothing to wait for: take what fits, or fail loudly if nothing does.
                chunk = self._largest_fit(seq, chunk)
                if chunk == 0:
                    raise RuntimeError("KV cache too small for a single block of prompt")
            else:
                self.blocks.free_seq(seq)
                return None
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        # Kept in arrival order, whatever the admission order: the latest arrival is the one
        # preempted first.
        at = bisect.bisect(self.running, seq.arrival_time, key=lambda q: q.arrival_time)
        self.running.insert(at, seq)
        return self._schedule_prefill(seq, budget, plan, chunk)

    def _largest_fit(self, seq: Sequence, chunk: int) -> int:
        free_slots = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
        return max(0, min(chunk, free_slots - seq.num_computed))

    def _schedule_prefill(self, seq: Sequence, budget: int, plan: StepPlan,
                          chunk: int | None = None) -> int:
        chunk = min(seq.num_uncomputed, budget) if chunk is None else chunk
        if not self.blocks.reserve(seq, chunk):
            chunk = self._largest_fit(seq, chunk)
            if chunk == 0 or not self.blocks.reserve(seq, chunk):
                return budget  # wait for blocks to come back
        plan.prefills.append(ScheduledPrefill(seq, chunk))
        return budget - chunk
