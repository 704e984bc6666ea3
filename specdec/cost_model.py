"""What a step costs on this machine: the target pass by query rows, whole decode steps by batch
size and rows per sequence, and (`CostModel.draft`, specdec/draft_costs.py) each drafter's
proposal by batch size and draft depth. The speculation controller (specdec/spec_control.py)
plans with it.

The pass curve is measured at start (specdec/calibration.py: one eager pass per size of a grid
of row counts, the fastest of a few, within a time budget) and cached per machine, model,
dtype, quantization, thread count and the code that runs the pass (`code_digest`: a kernel
made faster must not be planned with its old costs), so only the first start on a machine pays
for it. Real steps then refine it online.

A real step's cost is the median of its recent measurements (WINDOW per row count; an older one
is forgotten), a drafter's too: robust to a few steps slowed by another process, and with
overlap the only honest estimate of a step's period. The calibrated pass curve counts the pass
alone; outside the sizes real steps have covered, the calibrated pass plus what the nearest
real step added to it (host work) stands in. Between measured sizes the cost is interpolated
linearly, so a plan's cost never jumps where a bucket would end; past the largest measured
count it grows with the slope of the two largest (a larger pass is never assumed cheaper than
a smaller one).

A step that speculates costs more than a plain step of as many rows, and the difference is not a
matter of rows: each sequence that drafts has its tree built, its tree metadata laid out and its
verdict committed on the host, and on a GPU a plain step is chained on the device, its host
work hidden under the pass, where a drafted one waits for it. So the row curve is learnt from
plain steps alone (the cost plain decoding is compared at), and a drafted step's seconds less
that curve at its rows, its extra, is kept apart with the number of its sequences that drafted
(the recent WINDOW drafted steps of the last HOST_AGE steps): the median extra per such count,
then a line through those medians, its slope the median of their pairwise slopes (never below
zero) and its intercept the median residual (what speculating at all costs, whatever the
count). A plan with s drafting sequences over r rows costs pass_time(r) + spec_time(s). With one
count measured (a batch that always drafts whole, or the probes of a batch that does not) the
split cannot be told: below that count the extra is taken as proportional, above it as flat,
both estimates that err low and get tried, measured and corrected. The age limit makes probes
the only evidence once speculation stops, so a cost that has dropped shows within HOST_AGE
steps. The split never prices a drafted pass below a plain step of the batch (its rows are at
least that many): on an H200 it once read -4.4 ms at 144 rows, and a plan then took k = 8 for
an n-gram drafter whose fourth position survived 9% of the time.

The machine's pace changes under a running server (on the 2-core CPU a plain step read 30 ms
and 45 ms minutes apart, as neighbours came and went), and a cost is measured only while the
choice that pays it is made: a draft depth not chosen lately, or the target's plain step while
every step drafts, keeps the value of its time. Priced beside a fresh one, a stale cost decides
wrongly and then is not measured again: a server that had drafted through a slow spell and found
the machine fast again saw its old draft and verification costs against its new plain steps,
went plain, and stayed plain on a prompt that speculating ran 1.37x faster in the same process.
So every measurement is kept divided by `speed`, the pace at its time, and priced times the pace
now. The pace is the median of the recent PACE_WINDOW target steps' times over the calibrated
pass at their rows: a step slowed by another process moves it no more than a median moves, a
machine that stays slower moves it within a few steps. It is anchored to the calibration, which
stays fixed: priced against the curves it normalises, each new reading would be the pace of the
readings before it, and the pace a random walk (it was, at first: in a server trace it wandered
from 0.75 to 3.5 over eleven requests while the target's steps took 27-35 ms throughout). Only
the target sets it: a draft model's proposal varies with where `p_min` cuts it, and a lookup's
is microseconds of host work. Every cost then moves together, so what a plan compares keeps its
proportions, and a choice seen at one pace holds at another.

A runner that pads every sequence of a step to the deepest one's rows (CUDA graph buckets: B
sequences of Q rows) has a simpler model, and one the split cannot give there (its rows and
drafting sequences grow together, so the two terms are not told apart): the whole step's
seconds by batch size and rows per sequence, measured (`steps`, `step_time`). A (B, Q) not
measured yet is priced from the nearest measured Q at that batch, moved by what the
split model says the difference costs; at a batch never measured, by the split model alone.
Steps are kept and priced by the bucket that runs them (`pad`): 3 rows a sequence cost what 4
do, and 9 what 16 do. Priced by their own rows, a step of 9 was the one row past a measured 8
and looked 8% dearer; it ran in the 16-row bucket at 1.7x (an H100 at batch 64, 18.5 ms
planned, 30.9 measured: bench/results/gpu_goodput_h100_20261207_s32_b_trace.jsonl).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

from specdec.calibration import measure_curve
from specdec.cost_curve import WINDOW, Curve, lower_median
from specdec.draft_costs import DraftCosts

HOST_AGE = 128  # recorded steps a drafted step's extra counts for (four probes apart)
PACE_WINDOW = 9  # recent target steps whose median time over price is the pace


IDLE_GAP = 0.1  # seconds between engine calls past which the engine sat idle (see step_period)


def step_period(in_call: float, gap: float) -> float | None:
    """What a decode step took, with overlap (its successor launched before it is read back):
    the call that commits it waits only for what is left of it on the device, while the device
    worked on through the `gap` since the call before returned, so the step's period is call
    and gap together. Priced by its call alone, the first drafted step of an H100 batch-1 run
    read 0.89 ms against its 5.9 (the benchmark synchronised in the gap), the controller priced
    plain steps at 0.53 ms from it and kept the batch plain. A gap over IDLE_GAP is an engine
    left idle (no requests), whose step tells nothing: None."""
    return in_call + gap if 0.0 <= gap <= IDLE_GAP else None


class CostModel:
    def __init__(self) -> None:
        # A larger pass than any measured is assumed to cost what the largest did: tried
        # once, then measured.
        # Real plain steps: the median of the recent ones per row count. With overlap one
        # call's time is the step's period only on average (a call that finds the device
        # done returns fast, the next one waits longer), so the fastest is no estimate of it.
        self.passes = Curve(typical=True)
        self.calibration = Curve()  # passes alone, measured at start
        self.draft = DraftCosts(lambda: self.speed)  # each drafter's proposals
        # Drafted steps: (steps recorded then, sequences that drafted, seconds over the rows).
        self._extra: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._steps = 0
        self._line: tuple[float, float, int] | None = None  # spec_time's, while it holds
        # Decode steps, whole: batch size -> seconds by rows per sequence (drafters left out),
        # both as the runner's bucket pads them (`pad`: (batch, rows) -> (B, Q), or None where
        # no bucket holds the step).
        self.steps: dict[int, Curve] = {}
        self.pad: Callable[[int, int], tuple[int, int] | None] | None = None
        self._step_drafting: dict[int, int] = {}  # batch -> sequences the last drafted step drafted
        # Plain steps chained on the device (specdec/chaining.py), by batch as padded: what a
        # plain choice held between probes costs (`_step`).
        self.resting: dict[int, Curve] = {}
        # The machine's pace: every curve above (the calibrations aside) holds seconds divided
        # by the pace at their time, and every price is times the pace now. It starts at 1, the
        # calibration's, and that 1 stays in the window until PACE_WINDOW steps.
        self._paces: deque[float] = deque([1.0], maxlen=PACE_WINDOW)
        self.speed = 1.0
        # Followed where the engine says so, on the CPU. It leaves the pace at 1 on a GPU: the
        # device is not shared with neighbours, and a step's time there moves with how host
        # and device overlap (a call that finds the device done returns fast, the next waits
        # longer), which a pace would take for the machine's. Followed there (f5edd21's pace,
        # read against the curves), the controller fell to 0.69-0.74x of the best fixed k in
        # three of twelve cells at batch 1-16 (bench/results/gpu_goodput_h100_20261206_
        # f5edd21_b.json, against 0.92-1.09x in the runs before).
        self.follows_pace = False

    def _observe(self, rows: int, seconds: float) -> None:
        """A target step over `rows` took `seconds`, host work included: a drafted step's share
        of it (5 ms of 51 on the CPU at batch 1) reads as pace while every step drafts, a
        bias of that size, where leaving it out by the extra fitted from the same steps made
        the pace and the fit feed each other (the pace fell to 0.43 on a steady machine)."""
        cal = self.calibration(rows) if self.follows_pace and self.calibration else 0.0
        if cal > 0.0 and seconds > 0.0:
            self._paces.append(seconds / cal)
            self.speed = lower_median(self._paces)

    # -- the target pass --------------------------------------------------------------------
    def record_pass(self, rows: int, seconds: float, speculating: int = 0,
                    chained: bool = False, batch: int = 0) -> None:
        """A real step over `rows` query rows took `seconds` (its drafting left out);
        `speculating` of its sequences verified a draft. A `chained` step (its successor
        launched from its verdict on the device, specdec/chaining.py) has no host work of its
        own to speak of, drafted or not, so its time is the pass's at its rows; its speculating
        sequences still count, at that extra, towards what drafting costs beyond the pass.
        A drafted step planned on the host is split: what it took beyond the pass so far priced
        is its sequences' extra, and what it took beyond the extra so far fitted is the pass's.
        Its rows come in the batched shape the calibration does not time (one segment there:
        on an H200 it read 20 ms at 144 rows where 16 sequences drafting 8 deep took 10.5 ms
        in all), so without this a drafted batch's rows would be priced by that one segment
        for good. The split settles where the pass takes what the rows cost and the extra what
        is left; where only one count of drafting sequences is seen it cannot tell them
        apart, and only their sum is priced, which is what a plan of that batch needs.
        `batch`: the step's sequences (a pass over its rows costs at least a plain step of
        them)."""
        self._observe(rows, seconds)
        seconds /= self.speed
        self._steps += 1
        self._line = None
        if speculating == 0 or chained:
            self.passes.record(rows, seconds)
        if speculating > 0:
            self._extra.append((self._steps, speculating, seconds - self._pass(rows)))
            if not chained:
                self._line = None
                floor = self._pass(batch) if 0 < batch < rows else 0.0
                self.passes.record(rows, max(floor, seconds - self._spec(speculating)))
                self._line = None

    def record_step(self, batch: int, rows_per_seq: int, seconds: float,
                    drafting: int | None = None, chained: bool = False) -> None:
        """A decode step of `batch` sequences, the deepest of `rows_per_seq` rows (its root
        and draft nodes), took `seconds`, its drafting left out; `drafting` of them drafted
        (default: all, where it has draft rows); `chained`: its successor was launched from
        it on the device."""
        if batch > 0 and rows_per_seq > 0:  # (record_pass saw the same step: no _observe)
            if rows_per_seq > 1:
                self._step_drafting[self._padded(batch, 1)[0]] = (
                    batch if drafting is None else drafting)
            batch, rows_per_seq = self._padded(batch, rows_per_seq)
            self.steps.setdefault(batch, Curve(typical=True)).record(rows_per_seq,
                                                                     seconds / self.speed)
            if chained and rows_per_seq == 1:
                self.resting.setdefault(batch, Curve(typical=True)).record(
                    1, seconds / self.speed)

    def _padded(self, batch: int, rows_per_seq: int) -> tuple[int, int]:
        return (self.pad(batch, rows_per_seq) if self.pad else None) or (batch, rows_per_seq)

    def step_time(self, batch: int, rows_per_seq: int, drafting: int) -> float:
        """Seconds of a decode step of `batch` sequences padded to `rows_per_seq` rows each,
        `drafting` of them with a draft: measured; between measured sizes at this batch,
        interpolated; beyond them, the nearest one moved by the split model's difference
        (never cheaper for more rows, nor dearer for fewer); at a batch never measured, the
        split model's pass_time + spec_time."""
        return self._step(batch, rows_per_seq, drafting) * self.speed

    def _step(self, batch: int, rows_per_seq: int, drafting: int) -> float:
        batch, rows_per_seq = self._padded(batch, rows_per_seq)
        if rows_per_seq == 1 and batch in self.resting:
            # A plain choice is held, and its steps chained, until the next probe: priced by
            # chained plain steps where some were measured, not by the host-planned ones that
            # come between drafted steps (at batch 32 on an H100 those read 8.4 ms where off's
            # chained ones took 6.8, and an n-gram batch held 7 deep at 0.974x of off:
            # bench/results/gpu_goodput_h100_20261208_s35_b32_trace.jsonl, steps 573-575).
            return self.resting[batch](1)

        def split(q: int, s: int) -> float:
            return self._pass(batch * q) + self._spec(s if q > 1 else 0)

        curve = self.steps.get(batch)
        if not curve:
            return split(rows_per_seq, drafting)
        xs = curve.sizes
        if rows_per_seq in curve.best or xs[0] < rows_per_seq < xs[-1]:
            return curve(rows_per_seq)
        near = xs[0] if rows_per_seq < xs[0] else xs[-1]
        # The measured step is moved by the split model's difference, each side with its own
        # drafting sequences: a plain step priced from drafted ones sheds their host work (on
        # an H100 at batch 16, 9.4 ms planned for a plain step of 6.0, from one 8-row step;
        # the batch then drafted an n-gram 7 deep at 0.94x of off).
        est = (curve.best[near] + split(rows_per_seq, drafting)
               - split(near, self._step_drafting.get(batch, batch)))
        if rows_per_seq > near:
            return max(est, curve.best[near])
        # ... and never below the pass at its rows (a step is at least its pass): the host work
        # a drafted step is split into takes what the calibration's line past its largest
        # size misses of a big pass, and at batch 64 on an H100 the plain step so priced read
        # 3.7 ms against 7.6 (bench/investigations/controller_sim.py).
        return max(self._pass(batch * rows_per_seq), min(est, curve.best[near]))

    def deepest_step(self, batch: int) -> int:
        """The most rows per sequence of a whole decode step measured at the batch size
        nearest `batch`, or that the calibration timed in all at `batch` sequences (its rows
        come in a decode step's shape: specdec/calibration.py), less the one row a step adds;
        1 where neither says more: how deep a padding runner's plan may go this step (one
        deeper than measured, q = k + 1)."""
        timed = max(self.calibration.best, default=0) // max(1, batch) - 1
        if not self.steps:
            return max(1, timed)
        return max(1, timed, max(self._near_steps(batch).sizes, default=1))

    def knows_step(self, batch: int, rows_per_seq: int) -> bool:
        """Whether a decode step of `batch` sequences of `rows_per_seq` rows is priced from its
        own bucket's measurements (whole steps at the batch size nearest, or, for draft rows,
        the calibration in a decode step's shape), not extrapolated. A plain step is known
        only measured: the calibrated pass leaves out its host work (at batch 128 on an H100,
        7.9 ms calibrated, 9.6 a step)."""
        b, q = self._padded(batch, rows_per_seq)
        if q > 1 and b * q <= max(self.calibration.best, default=0):
            return True
        return bool(self.steps) and q in self._near_steps(b).best

    def _near_steps(self, batch: int) -> Curve:
        batch = self._padded(batch, 1)[0]
        return self.steps[min(self.steps, key=lambda b: (abs(b - batch), -b))]

    def forget_steps(self) -> None:
        """Drop what real steps and proposals taught, keeping the calibrations: the costs of
        an engine that has just started."""
        self.passes = Curve(typical=True)
        self.draft.forget()
        self.steps.clear()
        self.resting.clear()
        self._step_drafting.clear()
        self._extra.clear()
        self._steps = 0
        self._line = None

    def knows(self, rows: int) -> bool:
        return rows in self.passes.best or rows in self.calibration.best

    @property
    def measured(self) -> dict[int, float]:
        """Seconds of a plain pass by the rows measured, at the pace now."""
        held = {**self.calibration.best, **self.passes.best}
        return {r: held[r] * self.speed for r in sorted(held)}

    def pass_time(self, rows: int) -> float:
        """Seconds of a plain step over `rows` query rows; 0.0 while nothing is measured.
        Within the range of real plain steps measured, theirs (interpolated); outside it, the
        calibrated pass plus what the real step nearest in size added to its calibrated pass
        (host work, which the calibration does not see)."""
        return self._pass(rows) * self.speed

    def _pass(self, rows: int) -> float:
        xs = self.passes.sizes
        if not self.calibration or (xs and xs[0] <= rows <= xs[-1]):
            return self.passes(rows)
        if not xs:
            return self.calibration(rows)
        near = xs[0] if rows < xs[0] else xs[-1]
        est = max(0.0, self.calibration(rows) + self.passes.best[near] - self.calibration(near))
        # Never cheaper than a smaller real step (nor dearer than a larger one): the calibration
        # times one segment of n rows, not a batch of them, and its shape can fall where a
        # real step's does not (on an H200 it read 1.2 ms at 288 rows against 5.3 at 32).
        return max(est, self.passes.best[near]) if rows > near else min(est, self.passes.best[near])

    def spec_time(self, speculating: int) -> float:
        """Seconds a step in which `speculating` sequences draft costs beyond a plain step of
        its rows (0.0 for none, and while no drafted step is measured)."""
        return self._spec(speculating) * self.speed

    def _spec(self, speculating: int) -> float:
        if speculating <= 0:
            return 0.0
        if self._line is None:
            self._line = self._fit_extra()
        base, per_seq, only = self._line
        if only:
            return max(0.0, base * min(1.0, speculating / only))
        return max(0.0, base + per_seq * speculating)

    def _fit_extra(self) -> tuple[float, float, int]:
        """(intercept, slope per drafting sequence, 0), or (the median, 0.0, the count) where
        one count of drafting sequences is measured."""
        by_count: dict[int, list[float]] = {}
        for at, count, extra in self._extra:
            if self._steps - at < HOST_AGE:
                by_count.setdefault(count, []).append(extra)
        med = {c: statistics.median(xs) for c, xs in sorted(by_count.items())}
        if len(med) <= 1:
            return next(((m, 0.0, c) for c, m in med.items()), (0.0, 0.0, 0))
        slope = max(0.0, statistics.median(
            (med[b] - med[a]) / (b - a) for a, b in itertools.combinations(med, 2)))
        return statistics.median(m - slope * c for c, m in med.items()), slope, 0

    # -- calibration ------------------------------------------------------------------------
    def calibrate(self, run_pass: Callable[[int], None], max_rows: int,
                  cache: Path | None = None) -> dict[int, float]:
        """Measure (or load from `cache`) the pass curve up to `max_rows` rows. `run_pass(n)`
        runs one target pass of n query rows and returns when it is done."""
        curve = measure_curve(run_pass, max_rows, cache)
        for r, sec in curve.items():
            self.calibration.record(r, sec)
        return curve
