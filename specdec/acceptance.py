"""Acceptance evidence per draft position: what the speculation controller
(specdec/spec_control.py) estimates a sequence's survival S_1 .. S_k from.

Per request and drafter, and per drafter over every request (its profile), recency-weighted
counts of verifications that drafted j deep and of those that accepted j deep; an estimate is
shrunk towards a prior (a request's towards its drafter's profile, a profile towards a
geometric guess) and never grows with depth.

A request's prior (its drafter's profile) can count for more while its evidence is new (the
controller asks it of a calibrated model drafter, SpeculationController.verified): it starts
worth PRIOR_WEIGHT_NEW verifications and fades with each verification like any evidence, down
to PRIOR_WEIGHT, the weight a profile's own prior (the geometric guess) has throughout. With
a fixed weight of 2, one rejected first draft took a new HumanEval request's first-position
estimate from its drafter's 0.81 to 0.54, and the CPU server kept it plain for the rest of its
128 tokens (its draft model fell behind, so that evidence no longer faded; 6 draft tokens in
all), where the same server's next run drafted 165 tokens for it at 0.70 on the first position
and ran 1.40x plain (bench/results/cpu_vs_llamacpp_20261206_trace_{1,2}.json, prompt 5, and
server_trace_20261206_run1_prompt5.jsonl from bench/investigations/server_trace). In that run
the six requests' first-position acceptance ranged 0.68-0.96: a spread that a prior worth
several verifications describes. Within a request acceptance moves (prose against code), and
the floor keeps a long-lived sequence's estimate its own.

A request's prior is its drafter's profile less the request's own part of it (`Share`): counted
in both, a verification would weigh twice, and a fresh server's first request (the profile all
its own) went plain after four rejections at the n-gram profile's 0.28 first-position
acceptance (its first-position estimate 0.6 -> 0.07; 0.22 counted once), then stayed plain for
the rest of its tokens where drafting 8 deep paid 1.66x on an H100
(bench/results/gpu_goodput_h100_20261207_b.json, batch 1).
"""

from __future__ import annotations

PRIOR_WEIGHT = 2.0  # a prior is worth this many verifications of evidence, at least
PRIOR_WEIGHT_NEW = 6.0  # ... and this many before any (fading with them, down to PRIOR_WEIGHT)
DECAY = 0.9  # a request's evidence fades by this per verification
DRAFTER_DECAY = 0.995  # ... a drafter's profile over every request, more slowly
IDLE_DECAY = 0.97  # ... a request's, for each step that verifies none of its drafts
SHARE_NEGLIGIBLE = 0.02  # a request's share of a profile left in below this part of it


class Acceptance:
    """Recency-weighted counts per draft position j (depth j + 1): verifications that drafted
    that deep, and those that accepted that deep."""

    def __init__(self, decay: float = DECAY, prior_weight: float = PRIOR_WEIGHT) -> None:
        self.decay = decay
        self.offered: list[float] = []
        self.accepted: list[float] = []
        self.reached: list[float] = []  # ... and those whose drafter drafted that deep
        self.prior_weight = prior_weight
        self.step = 0  # the controller's step the counts are current at
        self.seen = 0  # verifications observed (a profile's clock for its requests' shares)
        # The last survival asked, (k, prior) -> S: each step asks the drafter's profile the same
        self._last: tuple[tuple[int, tuple[float, ...]], list[float]] | None = None

    def observe(self, depth: int, accepted: int, step: int = 0,
                drafted: int | None = None) -> None:
        """A verification of a draft asked `depth` deep, of which the drafter drafted
        `drafted` (default all: a model drafter may stop short, Drafter.last_asked) and the
        target accepted `accepted`."""
        if depth <= 0:
            return  # nothing was drafted: nothing learnt (an n-gram lookup without a match)
        drafted = depth if drafted is None else drafted
        self.step = max(self.step, step)
        self.seen += 1
        self._last = None
        self.prior_weight = max(PRIOR_WEIGHT, self.prior_weight * self.decay)
        _fold(self, self.decay, depth, accepted, drafted)

    def fade(self, step: int) -> None:
        """Counts fade by IDLE_DECAY for each step before `step` since they were last current
        (a verification, or the last fade): a sequence kept plain after a run of rejections
        comes back to its prior (its drafter's profile) instead of staying plain on old
        evidence (on an H100 at batch 1 an n-gram sequence stayed plain for 245 of 254 steps
        where 8 deep paid 1.8x). The controller fades only where drafting again is cheap."""
        idle = step - self.step - 1
        if idle > 0 and self.offered:
            f = IDLE_DECAY ** idle
            self.offered = [o * f for o in self.offered]
            self.accepted = [a * f for a in self.accepted]
            self.reached = [r * f for r in self.reached]
            self._last = None
        self.step = max(self.step, step - 1)

    def survival(self, k: int, prior: list[float], less: Share | None = None) -> list[float]:
        """S_1 .. S_k: P(at least j accepted | drafted j deep), shrunk towards `prior` [k],
        never growing with j. Where a position has little evidence of its own, its prior is
        the position before it times the conditional acceptance measured last (a sequence
        drafted only 1 deep so far is not judged by a prior's guess of depth 2). `less`: a
        request's share of these counts, left out (a profile asked for that request's
        prior)."""
        less = self._material(less)
        key = (k, tuple(prior))
        if less is None and self._last is not None and self._last[0] == key:
            return list(self._last[1])
        offered, accepted, _ = self._counts(less)
        out: list[float] = []
        prev, ratio = 1.0, None
        for j in range(k):
            o = offered[j] if j < len(offered) else 0.0
            a = accepted[j] if j < len(accepted) else 0.0
            p = prior[j] if ratio is None or o >= 1.0 else prev * ratio
            w = self.prior_weight
            s = min(prev, (a + w * p) / (o + w))
            if o >= 1.0:
                # The conditional acceptance measured last. The first position's is no
                # conditional, and the lowest in every profile measured here (n-gram: 0.28 then
                # 0.51-0.80 after it; the draft model 0.68-0.85, then 0.69-0.88): after it, at
                # least the prior's (at batch 32 on an H100's costs an n-gram batch judged
                # position 2 by 0.29 x 0.29 stayed plain where 3 deep paid 1.1x of off).
                ratio = s / prev if prev > 0 else 0.0
                if j == 0 and len(prior) > 1 and prior[0] > 0:
                    ratio = max(ratio, prior[1] / prior[0])
            prev = s
            out.append(s)
        if less is None:
            self._last = (key, out)
        return list(out)

    def reach(self, k: int, prior: list[float], less: Share | None = None) -> list[float]:
        """D_1 .. D_k: P(the drafter drafts j deep | asked j deep), shrunk towards `prior`
        [k], never growing with j: what a proposal costs where a model drafter stops short
        (its pass j runs only where it drafts j deep). `less` as in `survival`."""
        offered, _, reached = self._counts(self._material(less))
        out: list[float] = []
        prev = 1.0
        for j in range(k):
            o = offered[j] if j < len(offered) else 0.0
            r = reached[j] if j < len(reached) else 0.0
            prev = min(prev, (r + self.prior_weight * prior[j]) / (o + self.prior_weight))
            out.append(prev)
        return out

    def _material(self, less: Share | None) -> Share | None:
        """`less`, or None where it is at most SHARE_NEGLIGIBLE of these counts (a request among
        many): then every request asks the same survival, computed once a step (at batch 128
        the subtraction for each took the controller's host time per step 1.9 -> 2.6 ms,
        bench/investigations/controller_host.py)."""
        if less is None or not less.offered or not self.offered:
            return None
        f = self.decay ** (self.seen - less.at)
        return less if less.offered[0] * f > SHARE_NEGLIGIBLE * self.offered[0] else None

    def _counts(self, less: Share | None) -> tuple[list[float], list[float], list[float]]:
        """(offered, accepted, reached), less `less`'s share where given."""
        if less is None or not less.offered:
            return self.offered, self.accepted, self.reached
        f = self.decay ** (self.seen - less.at)
        return tuple([max(0.0, c - f * (x[j] if j < len(x) else 0.0)) for j, c in enumerate(cs)]
                     for cs, x in ((self.offered, less.offered), (self.accepted, less.accepted),
                                   (self.reached, less.reached)))


class Share:
    """One request's part of its drafter's profile: the counts its verifications added there,
    decayed as the profile decays them (by the profile's decay at each verification it
    observes, any request's), current at the profile's verification `at`."""

    def __init__(self) -> None:
        self.offered: list[float] = []
        self.accepted: list[float] = []
        self.reached: list[float] = []
        self.at = 0

    def add(self, profile: Acceptance, depth: int, accepted: int, drafted: int | None) -> None:
        """After `profile` observed this request's verification (`Acceptance.observe`'s
        arguments)."""
        if depth <= 0:
            return
        drafted = depth if drafted is None else drafted
        _fold(self, profile.decay ** (profile.seen - self.at), depth, accepted, drafted)
        self.at = profile.seen


class Evidence:
    """Every request's evidence per drafter, each drafter's profile over every request, and
    each request's share of that profile: what the speculation controller estimates S_j and
    D_j from."""

    def __init__(self) -> None:
        self.seqs: dict[tuple[str, str], Acceptance] = {}  # (request, method)
        self.drafters: dict[str, Acceptance] = {}  # method -> profile over every request
        self.shares: dict[tuple[str, str], Share] = {}  # (request, method) -> its part there

    def observe(self, request_id: str, method: str, depth: int, accepted: int, step: int,
                drafted: int | None, firm: bool) -> None:
        """A verification (`Acceptance.observe`'s arguments) at the controller's `step`.
        `firm`: a new request's estimate holds to the profile as PRIOR_WEIGHT_NEW
        verifications at first (else PRIOR_WEIGHT)."""
        key = (request_id, method)
        own = self.seqs.get(key)
        if own is None:
            own = self.seqs[key] = Acceptance(
                prior_weight=PRIOR_WEIGHT_NEW if firm else PRIOR_WEIGHT)
        own.observe(depth, accepted, step, drafted)
        profile = self.observe_profile(method, depth, accepted, drafted)
        share = self.shares.get(key)
        if share is None:
            share = self.shares[key] = Share()
        share.add(profile, depth, accepted, drafted)

    def observe_profile(self, method: str, depth: int, accepted: int,
                        drafted: int | None) -> Acceptance:
        """A verification counted in its drafter's profile alone: a request whose depth the
        controller does not choose (its own fixed k) needs no estimate of its own, nor its
        part of the profile left out of one. Returns the profile."""
        profile = self.drafters.get(method)
        if profile is None:
            profile = self.drafters[method] = Acceptance(DRAFTER_DECAY)
        profile.observe(depth, accepted, drafted=drafted)
        return profile

    def survival(self, request_id: str, method: str, k: int, prior: list[float], step: int,
                 fade: bool) -> list[float]:
        """S_1 .. S_k: the request's own evidence over its drafter's profile less its own part
        there, over `prior`; `fade`: its evidence first fades to `step` (Acceptance.fade)."""
        key = (request_id, method)
        profile = self.drafters.get(method)
        if profile is not None:
            prior = profile.survival(k, prior, self.shares.get(key))
        own = self.seqs.get(key)
        if own is None:
            return prior
        if fade:
            own.fade(step)
        return own.survival(k, prior)

    def reach(self, request_id: str, method: str, k: int) -> list[float]:
        """D_1 .. D_k, as `survival` is made, over never stopping short."""
        key = (request_id, method)
        prior = [1.0] * k
        profile = self.drafters.get(method)
        if profile is not None:
            prior = profile.reach(k, prior, self.shares.get(key))
        own = self.seqs.get(key)
        return prior if own is None else own.reach(k, prior)

    def forget(self, request_id: str) -> None:
        """A request gone: its own evidence goes, its part of the profiles stays."""
        for d in (self.seqs, self.shares):
            for key in [k for k in d if k[0] == request_id]:
                del d[key]

    def clear(self) -> None:
        self.seqs.clear()
        self.drafters.clear()
        self.shares.clear()


def _fold(c: Acceptance | Share, f: float, depth: int, accepted: int, drafted: int) -> None:
    """Counts `c` decayed by `f`, then one verification added: offered to `depth`, accepted to
    `accepted`, drafted to `drafted`, per position."""
    n = max(depth, len(c.offered))
    for counts in (c.offered, c.accepted, c.reached):
        counts += [0.0] * (n - len(counts))
    for j in range(n):
        c.offered[j] = c.offered[j] * f + (j < depth)
        c.accepted[j] = c.accepted[j] * f + (j < accepted)
        c.reached[j] = c.reached[j] * f + (j < drafted)


def geometric(a: float, k: int) -> list[float]:
    return [a ** (j + 1) for j in range(k)]
