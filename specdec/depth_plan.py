"""The choice of draft depths for one step, given each sequence's alternatives (drafter, depth
limit, per-position survival) and what steps and drafters cost: pure functions, no state. The
speculation controller (specdec/spec_control.py) learns the survivals and costs and calls them;
the algorithm is described there.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Alternative:
    """One way a sequence can speculate this step: a drafter, how deep it may go, its tree
    width (nodes per unit of depth) and its survival S_1 .. S_max_k."""

    method: str
    max_k: int
    width: int
    survival: list[float]
    lookup: bool = False  # a lookup drafter: free, but it may find nothing to propose
    # A model drafter behind on this sequence's tokens (it has not drafted for it lately): its
    # next proposal first feeds all it missed, `catch_up` seconds beyond a usual one (0.0 where
    # its pass is not calibrated), so a probe starts it only where that is cheap.
    stale: bool = False
    catch_up: float = 0.0
    # Seconds a step costs on top while this sequence drafts: a stale drafter's catch-up (a
    # prefill of the prompt, for a new request) spread over the steps the sequence has left
    # (`SpeculationController.start_cost`).
    start: float = 0.0
    # D_1 .. D_max_k, the chance that its drafter drafts j deep when asked, where it may stop
    # short (a draft model's `p_min`): its pass j runs only then, and its tree has a position
    # j to verify only then. None: it never stops.
    reach: list[float] | None = None

    def rows(self, j: int) -> float:
        """The query rows that asking position j (0-based) adds to a step, expected: a tree
        verifies what its drafter drafted, not the depth it was asked (on the 2-core CPU at
        batch 1, ShareGPT steps asked 4 deep of the draft model were priced 42.4 ms at the rows
        asked, 34.8 at those expected, and took 33.5:
        bench/results/cpu_controller_rows_20261207_b1.json)."""
        return self.width * (self.reach[j] if self.reach and j < len(self.reach) else 1.0)


@dataclass
class Candidate:
    """A sequence the controller chooses for this step, with the ways it can speculate."""


    request_id: str
    alternatives: list[Alternative]  # one, or an `auto` request's drafters


@dataclass
class Choice:
    """What the controller chose for a candidate: its drafter and depth."""


    alternative: int  # index into the candidate's alternatives
    k: int
    fallback: int | None = None  # an alternative to draft with if the chosen lookup finds none
    fallback_k: int = 0


PassTime = Callable[[float], float]  # query rows (expected, where drafts stop short) -> seconds
DraftTime = Callable[[str, int, int], float]  # (method, drafting sequences, depth) -> seconds
SpecTime = Callable[[int], float]  # drafting sequences -> seconds beyond the rows' pass


def best_depths(alts: list[Alternative], base_rows: int, plain: int, pass_time: PassTime,
                draft_time: DraftTime, tie: float = 0.0, margin: float = 0.0,
                spec_time: SpecTime | None = None) -> tuple[list[int], float]:
    """Depth per alternative (one per sequence) that maximises expected emitted tokens per
    second of the step, and that rate. `base_rows`: the step's rows before any draft node;
    `plain`: sequences in it that sample one token without speculating; `spec_time`: what a
    step costs beyond `pass_time` of its rows for its sequences that draft. Among allocations
    within `tie` of the best rate, the one that emits the most wins; and speculation at all
    only where its rate beats plain decoding's by `margin` (measured costs are noisy, and a
    choice that gains 2% on paper can lose 5% in fact)."""
    n = len(alts)
    # Each cost asked once: the orders scanned share most of their rows and depths.
    pass_time, draft_time = functools.cache(pass_time), functools.cache(draft_time)
    host = functools.cache(spec_time) if spec_time else (lambda s: 0.0)
    methods = sorted({a.method for a in alts})
    costly = [m for m in methods if draft_time(m, sum(a.method == m for a in alts), 1) > 0]
    deepest = {m: max(a.max_k for a in alts if a.method == m) for m in methods}

    def rate_of(gain: float, rows: int, cost: float) -> float:
        cost += pass_time(rows)
        return gain / cost if cost > 0 else gain

    found = [(rate_of(plain + n, base_rows, 0.0), float(plain + n), 0, 0)]  # rate, gain, order,
    orders: list[list[tuple[int, int]]] = [[]]  # ... its prefix; found[0]: no draft at all

    def scan(items: list[tuple[float, int, int]]) -> None:
        items.sort(key=lambda t: -t[0])  # stable: a sequence's positions stay in order
        orders.append([(i, j) for _, i, j in items])
        gain, rows, speculating, starting = float(plain + n), base_rows, 0, 0.0
        drafting = {m: 0 for m in methods}
        depth_of = {m: 0 for m in methods}
        for p, (_, i, j) in enumerate(items, 1):
            a = alts[i]
            gain += a.survival[j]
            rows += a.rows(j)
            if j == 0:
                drafting[a.method] += 1
                speculating += 1
                starting += a.start
            if j >= depth_of[a.method]:
                depth_of[a.method] = j + 1
            cost = host(speculating) + starting
            for m in methods:
                if drafting[m]:
                    cost += draft_time(m, drafting[m], depth_of[m])
            found.append((rate_of(gain, rows, cost), gain, len(orders) - 1, p))

    limits = []  # per cap on each costly drafter's depth, each sequence's deepest position
    for caps in itertools.product(*(range(deepest[m] + 1) for m in costly)):
        cap = dict(zip(costly, caps))
        limits.append([min(a.max_k, cap.get(a.method, a.max_k)) for a in alts])
        scan([(key, i, j) for i, a in enumerate(alts)
              for j, key in enumerate(_per_row(a, limits[-1][i]))])
    per_seq = (host(n) - host(1)) / (n - 1) if n > 1 else 0.0
    if per_seq > 0 or any(a.start for a in alts):
        first_best = max(f[0] for f in found)  # prices host work and starts, in tokens
        for limit in limits:
            items = []
            for i, a in enumerate(alts):
                gains = itertools.accumulate(a.survival[:limit[i]])
                rows = itertools.accumulate(a.rows(j) for j in range(limit[i]))
                price = first_best * (per_seq + a.start)
                bundle, value = max(((d, (g - price) / max(r, 1e-12))
                                     for d, (g, r) in enumerate(zip(gains, rows), 1)),
                                    key=lambda t: t[1], default=(0, 0.0))
                items += [(value, i, j) for j in range(bundle)]
                keys = _per_row(a, limit[i])
                items += [(keys[j], i, j) for j in range(bundle, limit[i])]
            scan(items)
    top = max(f[0] for f in found)
    if top <= (1 + margin) * found[0][0]:
        return [0] * n, found[0][0]
    rate, _, order, prefix = max((f for f in found if f[0] >= (1 - tie) * top),
                                 key=lambda f: (f[1], f[0]))
    ks = [0] * n
    for i, j in orders[order][:prefix]:
        ks[i] = j + 1
    return ks, rate


def _per_row(a: Alternative, limit: int) -> list[float]:
    """Each of `a`'s first `limit` positions' gain per expected row, pooled where a deeper
    position's would be higher (a draft model that drafts deep only where it is sure can be
    accepted more often per row there), so that they never grow with depth and a scan in
    their order takes a sequence's positions in order."""
    runs: list[list[float]] = []  # [gain, rows, positions]
    for j in range(limit):
        runs.append([a.survival[j], a.rows(j), 1])
        while len(runs) > 1 and runs[-1][0] * runs[-2][1] > runs[-2][0] * runs[-1][1]:
            g, r, n = runs.pop()
            runs[-1][0] += g
            runs[-1][1] += r
            runs[-1][2] += n
    return [g / max(r, 1e-12) for g, r, n in runs for _ in range(int(n))]


def union_reach(reaches: list[list[float]]) -> list[list[float]]:
    """Per n, the chance that at least one of the n sequences likeliest to draft deep drafts j
    deep (1 - the product of their 1 - D_j, as if independent): a batch's draft pass j runs
    then, and its proposals are measured at the depth of their deepest chain. At batch 2 on
    the 2-core CPU, fixed k = 4 on HumanEval, the likeliest sequence's D_j alone priced a
    proposal at 25.0 ms, this at 31.2, and it took 34.4; on ShareGPT 21.5 and 27.8 against
    20.3, where the reach estimates ran high
    (bench/results/cpu_controller_rows_20261208_b2.json)."""
    k = max((len(r) for r in reaches), default=0)
    out: list[list[float]] = []
    missed = [1.0] * k
    for r in sorted(reaches, key=lambda r: -sum(r)):
        missed = [m * (1.0 - (r[j] if j < len(r) else 0.0)) for j, m in enumerate(missed)]
        out.append([1.0 - m for m in missed])
    return out


StepTime = Callable[[int, int], float]  # (rows per sequence, drafting sequences) -> seconds


def uniform_depths(alts: list[Alternative], base_q: int, plain: int, step_time: StepTime,
                   draft_time: DraftTime, tie: float = 0.0,
                   margin: float = 0.0) -> tuple[list[int], float]:
    """`best_depths` for a runner that pads every sequence of a step to the deepest one's rows
    (CUDA graph buckets are B sequences of Q rows): one depth k for the batch, each sequence
    at min(k, its max_k), the k with the highest rate; none where speculation does not beat
    plain decoding by `margin`. Mixed depths there pay the deepest's rows for every sequence
    (on the H200 at batch 16 the controller's steps of depths 3 to 8 cost 11.5 ms where
    fixed k = 4 cost 7.3 ms at about the same tau). `base_q`: the rows per sequence the step
    has before the candidates draft (1, or a fixed-k request's tree); `step_time`: the whole
    step by its rows per sequence and drafting sequences (CostModel.step_time at the batch's
    size), host work included; `tie` as in best_depths."""
    n = len(alts)
    plain_cost = step_time(base_q, 0)
    plain_rate = (plain + n) / max(1e-12, plain_cost)
    found = [(plain_rate, float(plain + n), [0] * n)]
    sums = [list(itertools.accumulate(a.survival, initial=0.0)) for a in alts]  # S_1 + .. + S_d
    for k in range(1, max((a.max_k for a in alts), default=0) + 1):
        ks = [min(k, a.max_k) for a in alts]
        gain = float(plain + n) + sum(c[min(d, len(c) - 1)] for c, d in zip(sums, ks))
        q = max([base_q] + [1 + d * a.width for a, d in zip(alts, ks)])
        deepest: dict[str, tuple[int, int]] = {}  # method -> (drafting, depth)
        for a, d in zip(alts, ks):
            if d:
                cnt, dep = deepest.get(a.method, (0, 0))
                deepest[a.method] = (cnt + 1, max(dep, d))
        cost = step_time(q, sum(1 for d in ks if d)) + sum(a.start for a, d in zip(alts, ks) if d)
        cost += sum(draft_time(m, cnt, dep) for m, (cnt, dep) in deepest.items())
        found.append((gain / cost if cost > 0 else gain, gain, ks))
    top = max(f[0] for f in found)
    if top <= (1 + margin) * plain_rate:
        return [0] * n, plain_rate
    rate, _, ks = max((f for f in found if f[0] >= (1 - tie) * top), key=lambda f: (f[1], f[0]))
    return ks, rate
