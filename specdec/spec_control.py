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
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.outputs import SpecMetrics

PRIOR_ACCEPT = 0.6  # acceptance assumed before a request has any history
PRIOR_WEIGHT = 2.0  # ... worth this many draft tokens of evidence
EMA = 0.3


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


def acceptance(m: SpecMetrics | None) -> float:
    """Per-token acceptance probability: accepted tokens over draft trials (each verification
    that stopped early ends with one rejected trial)."""
    if m is None:
        return PRIOR_ACCEPT
    trials = m.accepted_tokens + m.rejected_steps
    return (m.accepted_tokens + PRIOR_ACCEPT * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)


def expected_tokens(a: float, k: int) -> float:
    if a >= 0.999:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class SpeculationController:
    def __init__(self) -> None:
        self.pass_time: dict[int, float] = {}  # bucketed query rows -> seconds per pass
        self.draft_time: dict[str, float] = {}  # drafter method -> seconds per unit of depth

    def record_pass(self, rows: int, seconds: float) -> None:
        b = _bucket(rows)
        old = self.pass_time.get(b)
        self.pass_time[b] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def record_draft(self, method: str, depth: int, seconds: float) -> None:
        if depth <= 0:
            return
        per = seconds / depth
        old = self.draft_time.get(method)
        self.draft_time[method] = per if old is None else (1 - EMA) * old + EMA * per

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
        accept = {c.request_id: acceptance(c.metrics) for c in cands}
        best_k, best_rate = 0, -1.0
        for k in range(max(c.max_k for c in cands) + 1):
            rows = base_rows + sum(min(k, c.max_k) * c.nodes_per_depth for c in cands)
            methods = {c.method for c in cands if min(k, c.max_k) > 0}
            cost = self._pass_cost(rows) + sum(self.draft_time.get(m, 0.0) * k for m in methods)
            gain = plain_decodes + sum(
                expected_tokens(accept[c.request_id], min(k, c.max_k)) for c in cands)
            rate = gain / cost if cost > 0 else float(gain)
            if rate > best_rate * 1.001:
                best_k, best_rate = k, rate
        return {c.request_id: min(best_k, c.max_k) for c in cands}
