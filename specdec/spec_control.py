"""Adaptive draft length: speculate only as far as it pays on this machine, at this load.

Verifying k draft tokens costs the target pass over more query rows (nearly free on a GPU at
batch 1, several decode steps on a CPU whose small matmuls are compute-bound, and growing with
the batch everywhere) plus the drafter's own time. A sequence whose drafts are accepted with
probability a emits (1 - a^(k+1)) / (1 - a) tokens per verification step on average. Each step
the controller picks the depth k that maximises expected tokens per second for the whole batch,
from costs measured online and each request's acceptance so far; k = 0 is plain decoding.

The pass without drafts is measured first; an unmeasured larger pass is assumed to cost what the
largest measured smaller one did, so the controller tries larger trees once and retreats when
they turn out to be expensive.

A shared machine only ever adds time to a step, so a cost is the fastest of its recent
measurements, not their mean: a few steps slowed by another process do not make speculation look
expensive. And every PROBE_EVERY steps the controller runs one step at another depth (1, 2, ...
max in turn), so that every depth's cost is measured and measured again, and a choice made in a
bad moment, plain decoding included, is not final. A drafter's time per unit of depth is not
kept for proposals that first had to catch up on tokens decoded without it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.outputs import SpecMetrics

PRIOR_ACCEPT = 0.6  # acceptance assumed before a request has any history
PRIOR_WEIGHT = 2.0  # ... worth this many draft tokens of evidence
WINDOW = 16  # recent measurements kept per cost
PROBE_EVERY = 32  # steps between probes of another depth
TIE = 0.03  # rates this close to the best count as equal


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class Candidate:
    """A speculating sequence of this step, as the controller sees it."""

    request_id: str
    method: str
    max_k: int  # the request's num_speculative_tokens
    metrics: SpecMetrics | None
    nodes_per_depth: int  # tree width: nodes added per unit of depth
    prior: float = PRIOR_ACCEPT  # acceptance assumed before its own evidence (see prior_for)


def acceptance(m: SpecMetrics | None, prior: float = PRIOR_ACCEPT) -> float:
    """Per-token acceptance probability: accepted tokens over draft trials (each verification
    that stopped early ends with one rejected trial)."""
    if m is None:
        return prior
    trials = m.accepted_tokens + m.rejected_steps
    return (m.accepted_tokens + prior * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)


def prior_for(totals: SpecMetrics | None) -> float:
    """A new request's prior: its drafter's acceptance over the requests so far, once there is
    enough of it (a fixed guess made every request start too shallow or too deep)."""
    if totals is None or totals.accepted_tokens + totals.rejected_steps < 16:
        return PRIOR_ACCEPT
    return acceptance(totals)


def expected_tokens(a: float, k: int) -> float:
    if a >= 0.999:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class SpeculationController:
    def __init__(self) -> None:
        self._pass: dict[int, deque[float]] = {}  # bucketed query rows -> recent seconds
        self._draft: dict[str, deque[float]] = {}  # drafter method -> seconds per depth
        self.pass_time: dict[int, float] = {}  # the fastest recent pass per bucket
        self.draft_time: dict[str, float] = {}  # the fastest recent drafting per unit of depth
        self._since_probe = 0
        self._probe = 0

    def record_pass(self, rows: int, seconds: float) -> None:
        b = _bucket(rows)
        window = self._pass.setdefault(b, deque(maxlen=WINDOW))
        window.append(seconds)
        self.pass_time[b] = min(window)

    def record_draft(self, method: str, depth: int, seconds: float, catch_up: int = 1) -> None:
        """`catch_up`: tokens the drafter had to feed before its first draft (more than the
        bonus token after steps that did not speculate). Such a proposal's time says little of
        what drafting costs every step, so it is not kept."""
        if depth <= 0 or catch_up > 2:
            return
        window = self._draft.setdefault(method, deque(maxlen=WINDOW))
        window.append(seconds / depth)
        self.draft_time[method] = min(window)

    def _pass_cost(self, rows: int) -> float:
        b = _bucket(rows)
        if b in self.pass_time:
            return self.pass_time[b]
        known = [k for k in self.pass_time if k < b]
        if known:
            return self.pass_time[max(known)]
        return min(self.pass_time.values(), default=0.0)

    def choose(self, base_rows: int, plain_decodes: int, cands: list[Candidate]
               ) -> dict[str, int]:
        """Depth per request id. `base_rows`: the step's query rows before any draft node;
        `plain_decodes`: sequences in it that decode without speculating."""
        if not cands:
            return {}
        if _bucket(base_rows) not in self.pass_time:
            # Measure plain decoding at this size once: everything is compared with it.
            return {c.request_id: 0 for c in cands}
        accept = {c.request_id: acceptance(c.metrics, c.prior) for c in cands}
        rates: list[float] = []
        for k in range(max(c.max_k for c in cands) + 1):
            rows = base_rows + sum(min(k, c.max_k) * c.nodes_per_depth for c in cands)
            methods = {c.method for c in cands if min(k, c.max_k) > 0}
            cost = self._pass_cost(rows) + sum(self.draft_time.get(m, 0.0) * k for m in methods)
            gain = plain_decodes + sum(
                expected_tokens(accept[c.request_id], min(k, c.max_k)) for c in cands)
            rates.append(gain / cost if cost > 0 else float(gain))
        # The deepest depth within TIE of the best: measured costs are noisy, and between
        # near-equal choices the deeper one emits more per step for the same predicted rate.
        best_k = max(k for k, r in enumerate(rates) if r >= (1 - TIE) * max(rates))
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:  # each probe tries the next depth, 1 .. max
            self._since_probe = 0
            self._probe = self._probe % max(c.max_k for c in cands) + 1
            best_k = self._probe
        return {c.request_id: min(best_k, c.max_k) for c in cands}
