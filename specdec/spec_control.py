"""Goodput control: each step, every speculating sequence's draft depth (zero included) and,
for `"method": "auto"`, its drafter, chosen to maximise the batch's expected emitted tokens per
second on this machine.

Verifying draft tokens costs the target pass over more query rows (nearly free on a GPU at
batch 1, several decode steps on a CPU whose small matmuls are compute-bound, and growing with
the batch everywhere) plus the drafters' own time (a draft model's proposal: one pass over its
catch-up tokens, then one per further depth). Costs come from specdec/cost_model.py
(calibrated at start, refined from real steps).

A sequence's value of drafting to depth k is its expected emitted tokens, 1 + S_1 + .. + S_k,
where S_j is the probability that its verification accepts at least j draft tokens, estimated
per draft position from the sequence's own recent verifications (recency-weighted, so that
acceptance that collapses or returns shows within a few steps), shrunk towards its drafter's
profile over every request (specdec/acceptance.py; a sequence's evidence also fades while it
is kept plain where drafting again costs no catch-up, so a stretch of rejections does not keep
it off for good). A position adds the rows its drafter is expected to draft there (a draft
model may stop short: D_j, Alternative.rows), and where a deeper position gains more per row a
run of them is pooled to its average, so a sequence's marginal gains per row fall with depth,
and for a fixed number of extra rows the best allocation takes the largest across the batch
(an exchange argument). `best_depths` scans those allocations, for every cap
on each costly drafter's depth (a draft model's time grows with the deepest chain it drafts),
and keeps the highest rate: for chains and per-drafter costs that do not depend on
how many sequences draft, that is the brute-force optimum (tests/test_depth_plan.py), a cost
of speculating at all included. Nothing switches at a batch size: as the batch grows, each
sequence's depth falls one step at a time where its marginal token stops paying for its row.

Each sequence that drafts also costs host work of its own (specdec/cost_model.py, `spec_time`),
which breaks the exchange argument: one sequence drafted two deep can beat two drafted one deep
over the same rows, because it pays the host once. So where that cost grows with the number of
drafting sequences the scan runs a second order too, in which a sequence's first positions come
as one bundle ranked by its tokens less that host cost (priced at the best rate the first order
found) per row, the best such bundle over its depths; its later positions follow by their
gains. That is the optimum where the pass costs the same for every further row; on curved costs
it is not always (a batch can need a bundle that no single price ranks first), but on random
batches it stays within 0.4% of the brute force (the tests hold it to 0.5%), where the first
order alone loses up to 8%.

Measured costs are noisy on a shared machine, so speculation is chosen only where it beats
plain decoding's predicted rate by MARGIN. Every PROBE_EVERY steps one sequence, in turn,
drafts one deeper than chosen (an `auto` one, every other time, with its other drafter): the
costs and acceptance next to each choice are measured again at the price of one row, and a
sequence whose speculation was turned off gets fresh evidence, so no choice is final. Where a
probe finds the choice where the last one left it, the period doubles, up to PROBE_MAX (at
batch 32 on the H200 a probe is a whole host-planned step one deeper, and a batch of n-gram
drafts that cannot pay paid 2-3% for them); a choice that moves, or a request that arrives,
brings it back to PROBE_EVERY. A probe
starts a model drafter that is behind on a sequence (it would first feed everything it missed,
a prefill of the context for a sequence it never drafted for) only where that catch-up costs
at most PROBE_START of the plain steps until the next probe: a new request still gets evidence
of its own when its drafter's profile over every request (or the prior, for the first
requests) says no; else one bad stretch of traffic would keep the drafter off for every request
after it (on the 2-core CPU, a 0.5b draft model behind 80-120-token prompts costs 140-240 ms to
catch up, 5-9 target steps, and with only a plain step allowed it never drafted again after
one rejected probe). Nor does a probe start such a drafter where the plan would keep it off
even if every one of its tokens were accepted (the 2-core CPU at batch 4-16, where a verified
row and the draft model's pass cost more than the token they could add): acceptance evidence
could not change that choice, and each such probe cost a catch-up. Between probes the choice
is held: where it gives every sequence the same depth and the drafts can be made on the device,
the engine chains those steps there without asking (specdec/chaining.py), and their acceptance
and cost are recorded as any step's.

`auto` requests carry several drafters. Each step a sequence takes the drafter with the higher
expected tokens per unit of cost; when that is a lookup drafter (n-gram) it comes with the best
model drafter as a fallback, used in the same step if the lookup finds no match. A drafter not
chosen keeps its state: a draft model catches up on the tokens it missed at its next proposal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from specdec.acceptance import Evidence, geometric
from specdec.cost_model import CostModel
from specdec.depth_plan import (
    Alternative,
    Candidate,
    Choice,
    best_depths,
    uniform_depths,
    union_reach,
)
from specdec.outputs import ControlStats

PRIOR_ACCEPT = 0.6  # per-position acceptance assumed before any evidence
# ... for a draft model, which shares the target's tokenizer and mostly its training: on the
# CPU's HumanEval prompts its first position accepted 0.91 against n-gram lookup's 0.31
# (bench/results/eagle_qwen2.5-coder-1.5b_20261206_int8.json), and from 0.6 a fresh server's
# first two requests barely drafted: one rejected probe left each plain to its end
# (bench/results/cpu_adaptive_sequence_20261206.json).
PRIOR_ACCEPT_BY_METHOD = {"draft_model": 0.8}
PROBE_EVERY = 32  # steps between probes (one sequence one step deeper, or its other drafter)
PROBE_MAX = 4 * PROBE_EVERY  # ... at most, where the probes keep finding the same choice
PROBE_START = 0.25  # a probe's catch-up of a drafter behind: at most this share of a period
TIE = 0.02  # speculative rates this close to the best count as equal (more tokens wins)
MARGIN = 0.05  # speculation must beat plain decoding's predicted rate by this much


class SpeculationController:
    def __init__(self, costs: CostModel | None = None) -> None:
        self.costs = costs or CostModel()
        self.evidence = Evidence()
        self._pending: dict[str, tuple[str, float]] = {}  # request -> (method, predicted)
        self._chosen: dict[str, tuple[str, float]] = {}  # ... of the last choice (`hold_step`)
        self.stats: dict[str, ControlStats] = {}
        self._since_probe = 0
        self._step = 0  # steps taken: chosen (`choose`) or held (`hold_step`)
        self._probe = 0
        self._all_off = False  # the last choice gave every candidate depth 0
        self._held = False  # the last choice had no probe in it: it may be held
        self._period = PROBE_EVERY  # steps from one probe to the next (`_back_off`)
        self._probed_ids: set[str] = set()  # the batch the last probe was made at,
        self._probed_choice: set[tuple[int, int]] = set()  # ... and its (drafter, depth)s
        # The runner pads a step's sequences to the deepest (CUDA graphs): one depth for all
        # (uniform_depths), priced by whole steps at the batch's size (CostModel.step_time),
        # and a probe takes the whole batch one deeper.
        self.uniform = False

    def pads_to(self, bucket: Callable[[int, int], tuple[int, int] | None]) -> None:
        """Plan for a runner that pads each step to a bucket of (sequences, rows each):
        `bucket(batch, rows)` -> (B, Q), or None where the step runs unpadded."""
        self.uniform = True
        self.costs.pad = bucket

    # -- what the controller learns -----------------------------------------------------------
    def record_pass(self, rows: int, seconds: float, speculating: int = 0,
                    chained: bool = False, batch: int = 0, deepest: int = 0) -> None:
        """A step of `batch` decodes over `rows` query rows, `deepest` the most of one
        sequence, took `seconds`, its drafters' time left out; `speculating` of its sequences
        had a draft verified; `chained`: the next step was launched from its verdict on the
        device, without the host planning it."""
        self.costs.record_pass(rows, seconds, speculating, chained, batch)
        self.costs.record_step(batch, deepest, seconds, speculating, chained)

    def record_draft(self, method: str, batch: int, depth: int, seconds: float,
                     catch_up: int = 1) -> None:
        """`catch_up`: tokens the drafter fed before its first draft (more than the bonus token
        after steps it sat out). Such a proposal says little of what drafting costs every
        step, so it is not kept."""
        if catch_up <= 2:
            self.costs.draft.record(method, batch, depth, seconds)

    def verified(self, request_id: str, method: str, depth: int, accepted: int,
                 emitted: int, drafted: int | None = None, chosen: bool = True) -> None:
        """A verification of `request_id`'s draft from `method`: `depth` deep (the depth it was
        asked for; `drafted`, the tree's depth, where the drafter stopped short), `accepted`
        of them accepted, `emitted` tokens out. Not `chosen`: the request's own fixed k, which
        its drafter's profile learns from, but which needs no estimate of its own and is
        nothing for the stats of the controller's choices. A request's estimate holds
        to its drafter's profile more firmly at first (PRIOR_WEIGHT_NEW) where the drafter is a
        model whose pass was calibrated: turned off, it falls behind, restarting it costs a
        catch-up and its evidence stops fading, so one early rejection could keep it off for
        good (specdec/acceptance.py). A lookup's, or an uncalibrated one's, fades back while
        it is kept plain and starts at PRIOR_WEIGHT (with the firmer prior on the H100, the
        n-gram profile's sequences at batch 1 stayed plain: 1.01x off against 1.69x before,
        `bench/results/gpu_goodput_h100_20261206_prior_b.json`)."""
        if not chosen:
            self.evidence.observe_profile(method, depth, accepted, drafted)
            return
        self.evidence.observe(request_id, method, depth, accepted, self._step, drafted,
                              firm=method in self.costs.draft.calibration)
        pending = self._pending.pop(request_id, None)
        st = self.stats.get(method)
        if st is None:
            st = self.stats[method] = ControlStats()
        st.depths[depth] += 1
        st.steps += 1
        st.emitted_tokens += emitted
        if pending is not None and pending[0] == method:
            st.predicted_tokens += pending[1]
        else:  # a fallback drafted instead of the planned lookup: predicted from its profile
            st.predicted_tokens += 1 + sum(self.survival(request_id, method, depth))

    def forget(self, request_id: str) -> None:
        self.evidence.forget(request_id)
        self._pending.pop(request_id, None)
        self._chosen.pop(request_id, None)

    def survival(self, request_id: str, method: str, k: int, fade: bool = True) -> list[float]:
        """S_1 .. S_k of this request with this drafter: its own evidence over its drafter's
        profile (less its own part there), over a geometric prior. `fade`: let evidence from
        before the steps it was kept plain fade (Acceptance.fade); not where starting the
        drafter again costs a catch-up (a draft model behind: on the 2-core CPU, retrying one
        whose drafts keep failing cost more than it found)."""
        prior = geometric(PRIOR_ACCEPT_BY_METHOD.get(method, PRIOR_ACCEPT), k)
        return self.evidence.survival(request_id, method, k, prior, self._step, fade)

    def reach(self, request_id: str, method: str, k: int) -> list[float]:
        """D_1 .. D_k of this request with this model drafter (the chance that it drafts j
        deep when asked, where it may stop short): its own evidence over its drafter's profile,
        over never stopping."""
        return self.evidence.reach(request_id, method, k)

    # -- a step's choice ----------------------------------------------------------------------
    def choose(self, base_rows: int, plain: int, cands: list[Candidate], batch: int = 0,
               base_q: int = 1) -> dict[str, Choice]:
        """Per candidate: its drafter and depth. `base_rows`: the step's rows before any draft
        node; `plain`: sequences in it that decode without speculating; `batch`: its decoding
        sequences (0: the candidates and `plain`) and `base_q` the most rows one of them has
        before the candidates draft (a fixed-k request's tree), for a runner that pads."""
        self._all_off = self._held = False
        self._step += 1
        if not cands:
            return {}
        if not self.costs.measured:
            # Measure plain decoding first: everything is compared with it.
            return {c.request_id: Choice(0, 0) for c in cands}
        passes, host = self.costs.pass_time, self.costs.spec_time
        batch = batch or plain + len(cands)
        # A model drafter that may stop short runs its pass j for a batch where any of its
        # sequences drafts j deep: n drafting sequences are priced by the chance that one of
        # the n likeliest to go deep does.
        reaches: dict[str, list[list[float]]] = {}
        for a in (a for c in cands for a in c.alternatives if a.reach is not None):
            reaches.setdefault(a.method, []).append(a.reach)
        unions = {m: union_reach(rs) for m, rs in reaches.items()}

        def drafts(method: str, n: int, depth: int) -> float:
            u = unions.get(method)
            return self.costs.draft.time(method, n, depth, u[min(n, len(u)) - 1] if u else None)

        def plan(alts: list[Alternative]) -> list[int]:
            if self.uniform:
                return uniform_depths(alts, base_q, plain,
                                      functools.partial(self.costs.step_time, batch), drafts,
                                      TIE, MARGIN)[0]
            return best_depths(alts, base_rows, plain, passes, drafts, TIE, MARGIN, host)[0]

        picks = [self._pick(c, base_rows + len(cands), len(cands)) for c in cands]
        alts = [c.alternatives[p] for c, p in zip(cands, picks)]
        ks = plan(alts)
        exploring = False
        if self.uniform:
            # The plan's depth, but no deeper than the calibration timed at this batch size or
            # one row past the whole steps measured near it (CostModel.deepest_step): a fresh
            # H100 at batch 64, planning from the prior, took 4 whole steps 8 deep for an
            # n-gram drafter (0.91x of off in all).
            # Where that binds, the next step asks again (no holding), one row deeper allowed,
            # until the measured costs stop the plan. The plan itself is not limited: at batch
            # 1 an n-gram drafter's first position alone did not pay, its eight did, and a plan
            # limited to one row deep stayed plain (1.0x against 1.96x for fixed k = 8).
            # Nor is a choice held whose step's bucket no step has measured (its price an
            # extrapolation): at batch 64 on an H100 the plan took 8 deep, one row past a
            # measured 8, for 32 steps planned at 18.5 ms that ran in the 16-row bucket at 31.
            cap = self.costs.deepest_step(batch)
            exploring = any(k > cap for k in ks)
            ks = [min(k, cap) for k in ks]
            q = max([base_q] + [1 + k * a.width for k, a in zip(ks, alts) if k])
            exploring = exploring or not self.costs.knows_step(batch, q)
        self._since_probe += 1
        due = self._since_probe >= self._period
        self._held = not due and not exploring
        if due:
            # One sequence, in turn, drafts one deeper than chosen (or, every other time for
            # an `auto` one, with its other drafter): the costs and acceptance next to the
            # choice are measured again, cheaply, so no choice is final.
            self._back_off(cands, picks, ks)
            self._since_probe = 0
            self._probe += 1
            i = self._probe % len(cands)
            c = cands[i]
            step = passes(base_rows + len(cands)) * self._period
            if len(c.alternatives) > 1 and (self._probe // len(cands)) % 2:
                other = (picks[i] + 1) % len(c.alternatives)
                if _startable(c.alternatives[other], step, plan, alts, i):
                    picks[i] = other
                    ks[i] = min(max(1, ks[i]), c.alternatives[other].max_k)
            elif self.uniform:  # the whole batch one deeper: what that depth would cost
                ks = [min(k + 1, a.max_k) if k > 0 or _startable(a, step) else k
                      for k, a in zip(ks, alts)]
            elif ks[i] > 0 or _startable(alts[i], step, plan, alts, i):
                ks[i] = min(ks[i] + 1, alts[i].max_k)
            alts[i] = c.alternatives[picks[i]]
        out = {c.request_id: Choice(p, k) for c, p, k in zip(cands, picks, ks)}
        # A lookup that finds nothing falls back to the model drafter the sequence would have
        # had, at the depth the batch would give it.
        looked = [i for i, a in enumerate(alts) if a.lookup and len(cands[i].alternatives) > 1]
        if looked:
            backs = [self._fallback(cands[i], picks[i]) for i in looked]
            model = list(alts)
            for i, b in zip(looked, backs):
                if b is not None:
                    model[i] = cands[i].alternatives[b]
            mks = plan(model)
            for i, b in zip(looked, backs):
                if b is not None and mks[i] > 0:
                    ch = out[cands[i].request_id]
                    ch.fallback, ch.fallback_k = b, mks[i]
        for c, ch in out.items():
            cand = next(x for x in cands if x.request_id == c)
            a = cand.alternatives[ch.alternative]
            self._pending[c] = (a.method, 1 + sum(a.survival[:ch.k]))
        self._all_off = all(ch.k == 0 and ch.fallback is None for ch in out.values())
        self._chosen = {c: self._pending[c] for c in out}
        return out

    def forget_evidence(self) -> None:
        """Drop every acceptance profile and the stats, keeping the costs: what a warm-up
        generation taught says nothing of the traffic that follows it."""
        self.evidence.clear()
        self._pending.clear()
        self._chosen.clear()
        self.stats.clear()

    def _back_off(self, cands: list[Candidate], picks: list[int], ks: list[int]) -> None:
        """The next probes' period: doubled (up to PROBE_MAX) where the choice is the one the
        last probe was made at, so a batch whose best choice stands does not pay for probes it
        no longer learns from (at batch 32 on the H200 a probe is a whole host-planned step one
        deeper); PROBE_EVERY again where the choice moved or a request arrived since."""
        ids = {c.request_id for c in cands}
        choice = set(zip(picks, ks))
        same = ids <= self._probed_ids and choice == self._probed_choice
        self._period = min(PROBE_MAX, 2 * self._period) if same else PROBE_EVERY
        self._probed_ids, self._probed_choice = ids, choice

    @property
    def probe_period(self) -> int:
        """Steps from one probe to the next now: PROBE_EVERY, up to PROBE_MAX while the probes
        keep finding the same choice."""
        return self._period

    @property
    def holding(self) -> bool:
        """Whether the last choice had no probe in it and the next probe is not due: until it
        is, the engine may take steps of the same depths on the device without asking
        (specdec/chaining.py), counting each with `hold_step`. Acceptance is still recorded
        from every step, and the next choice plans with it."""
        return self._held and self._since_probe + 1 < self._period

    @property
    def resting(self) -> bool:
        """Whether the choice held drafts for no one (plain steps chain then)."""
        return self._all_off and self.holding

    def hold_step(self) -> bool:
        """A step taken with the last choice's depths, without a choice: it counts towards the
        next probe. False when the choice may not be held (the step is planned on the host)."""
        if not self.holding:
            return False
        self._since_probe += 1
        self._step += 1
        self._pending.update(self._chosen)
        return True

    def _pick(self, c: Candidate, rows: int, batch: int) -> int:
        """The alternative with the most expected tokens per second of its own at its best
        depth: its tokens (the bonus one too) over its share of the step's pass, its extra
        rows, its drafter's share and its share of the host work of drafting. Extra tokens
        over extra cost alone would prefer a lookup that costs nothing and finds little to a
        draft model that finds much: on the 2-core CPU, where 2-4 rows cost one, `auto` took
        n-gram's 0.3 first-position acceptance over the draft model's 0.9 and ran 1.49x plain
        where the draft model alone ran 1.64x (bench/results/goodput_cpu_20261207_b12.json)."""
        if len(c.alternatives) == 1:
            return 0
        share = self.costs.pass_time(rows) / max(1, batch)
        per_row = max(1e-9, self.costs.pass_time(rows + 1) - self.costs.pass_time(rows))
        host = self.costs.spec_time(batch) / max(1, batch)
        best, best_value = 0, -1.0
        for idx, a in enumerate(c.alternatives):
            value = max(((1 + sum(a.survival[:k])) / (
                share + sum(map(a.rows, range(k))) * per_row + host + a.start
                + self.costs.draft.time(a.method, batch, k, a.reach) / max(1, batch))
                for k in range(1, a.max_k + 1)), default=0.0)
            if value > best_value:
                best, best_value = idx, value
        return best

    def start_cost(self, method: str, behind: int, left: int, survival: list[float]) -> float:
        """Seconds per step that starting `method` on a sequence costs on top of its usual
        proposals, where the drafter is `behind` tokens (it first feeds them all: for a new
        request, its whole prompt) and the sequence has at most `left` tokens to go: the
        catch-up pass beyond a usual one (2 tokens), spread over the steps that drafting
        `survival` deep takes to emit them. A request with few tokens left, behind a long
        prompt, does not start a costly drafter that could not pay it back (0.0 where the
        drafter's pass is not calibrated: an estimate that errs low is tried, then measured)."""
        extra = self.costs.draft.catch_up_time(method, behind)
        return extra * (1 + sum(survival)) / max(1, left) if extra > 0 else 0.0

    @staticmethod
    def _fallback(c: Candidate, picked: int) -> int | None:
        others = [i for i, a in enumerate(c.alternatives) if i != picked and not a.lookup]
        return others[0] if others else None


def _startable(a: Alternative, period: float,
               plan: Callable[[list[Alternative]], list[int]] | None = None,
               alts: list[Alternative] | None = None, i: int = 0) -> bool:
    """Whether a probe may draft with `a` (for sequence `i` of `alts`): its drafter is not
    behind, or its catch-up costs at most PROBE_START of the plain steps until the next probe
    (`period` seconds) and `plan` would draft with it were every one of its tokens accepted.
    Where not even that would pay, the probe could only confirm depth 0, after paying the
    catch-up: on the 2-core CPU at batch 8, a draft model kept off was probed twice in 96
    steps, each probe first reading the sequence's context, 0.64-0.72 s of proposals in 8.2 s
    of decoding (bench/results/cpu_batch_host_b8_20261206.json), where fixed k = 2 at tau 2.4
    read 0.6x of off. A drafter not behind is probed regardless: that costs a row, and measures
    its costs again (host work per drafting sequence, say, that has come down)."""
    if not a.stale:
        return True
    if a.catch_up > PROBE_START * period:
        return False
    if plan is None or alts is None:
        return True
    trial = list(alts)
    trial[i] = replace(a, survival=[1.0] * len(a.survival))
    return plan(trial)[i] > 0
