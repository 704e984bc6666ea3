"""What each drafter's proposal costs: seconds by method, batch size and draft depth. Part of
the cost model (specdec/cost_model.py), which holds one as `CostModel.draft` and shares its
pace with it: every time here is kept divided by the machine's pace at its measurement and
priced times the pace now (the pace is the target's; a drafter's proposal varies with where
`p_min` cuts it, and a lookup's is microseconds of host work, so neither sets it).

A model drafter (a draft model) is calibrated at start like the target (specdec/calibration.py:
its pass by rows), so what its proposals cost is known before it first proposes; real
proposals then scale that shape. A drafter without a calibration (n-gram, replay) is priced by
its measured proposals alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from specdec.calibration import measure_curve
from specdec.cost_curve import WINDOW, Curve, lower_median


class DraftCosts:
    def __init__(self, pace: Callable[[], float]) -> None:
        self.pace = pace  # the cost model's `speed`, read at each measurement and price
        # (method, drafting sequences) -> seconds by draft depth: a draft model's proposal is
        # one pass over its catch-up tokens, then one pass per further depth.
        self.measured: dict[tuple[str, int], Curve] = {}
        self.calibration: dict[str, Curve] = {}  # method -> its model's pass by rows
        # (method, drafting sequences) -> recent proposals of a calibrated model drafter, each
        # its time over its calibrated estimate (`_time`).
        self._ratios: dict[tuple[str, int], deque[float]] = {}

    def forget(self) -> None:
        """Drop what real proposals taught, keeping the calibrations."""
        self.measured.clear()
        self._ratios.clear()

    def record(self, method: str, batch: int, depth: int, seconds: float) -> None:
        """A proposal for `batch` sequences, `depth` deep at most, took `seconds`."""
        if depth > 0 and batch > 0:
            seconds /= self.pace()
            # The median: how much a proposal feeds varies (a sequence that ends soon drafts
            # less), so the fastest one is an outlier that did less work.
            self.measured.setdefault((method, batch), Curve(proportional=True, typical=True)
                                     ).record(depth, seconds)
            est = self._calibrated(method, batch, depth)
            if est:
                self._ratios.setdefault((method, batch), deque(maxlen=2 * WINDOW)).append(
                    seconds / est)

    def time(self, method: str, batch: int, depth: int,
             reach: list[float] | None = None) -> float:
        """Seconds of `method` proposing `depth` deep for `batch` sequences: where the drafter's
        pass was calibrated, that estimate (scaled by what real proposals cost against it, at
        this batch size or the nearest measured); else measured at this batch size; else what
        the nearest measured size cost, or 0.0 when never measured: an estimate that errs low
        is tried, measured and corrected; one that errs high would never be tried. `reach`
        (D_1 ..): where the drafter may stop short, the chance that it drafts j deep when asked;
        its pass j runs only then (each pass drafts a token, and a chain ends with its first
        unsure one), so depth j costs only that share (a proposal is recorded at the depth it
        ran)."""
        if reach is None or depth <= 1:
            return self._time(method, batch, depth) * self.pace()
        sec = prev = self._time(method, batch, 1)
        for j in range(2, depth + 1):
            cur = self._time(method, batch, j)
            sec += (reach[j - 1] if j - 1 < len(reach) else 1.0) * (cur - prev)
            prev = cur
        return sec * self.pace()

    def _time(self, method: str, batch: int, depth: int) -> float:
        if batch <= 0 or depth <= 0:
            return 0.0
        est = self._calibrated(method, batch, depth)
        known = [b for (m, b) in self._ratios if m == method]
        if est is not None and known:
            # A calibrated model's proposal: its calibrated shape (a pass a depth) times what
            # its recent proposals took against theirs, pooled over depths, at this batch size
            # or the nearest measured. Read per depth, a depth planned rarely (a probe one
            # deeper) kept the time of its few proposals: on the 2-core CPU, 60 ms at depth 4
            # against 30 at depth 3, and the controller stopped at 3 (server trace, 2026-12-06).
            near = min(known, key=lambda b: (abs(b - batch), b))
            return est * lower_median(self._ratios[(method, near)])
        curve = self.measured.get((method, batch))
        if curve is not None:
            return curve(depth)
        known = [b for (m, b) in self.measured if m == method]
        if not known:
            return est or 0.0
        near = min(known, key=lambda b: (abs(b - batch), b))
        measured = self.measured[(method, near)](depth)
        ref = self._calibrated(method, near, depth)
        return est * measured / ref if est is not None and ref else measured

    def catch_up_time(self, method: str, tokens: int) -> float:
        """Seconds a proposal that first feeds `tokens` a model drafter missed costs beyond a
        usual one (which feeds 2), from its calibrated pass; 0.0 where it is not calibrated."""
        c = self.calibration.get(method)
        return max(0.0, c(tokens) - c(2)) * self.pace() if c and tokens > 2 else 0.0

    def _calibrated(self, method: str, batch: int, depth: int) -> float | None:
        """A proposal from the drafter's calibrated pass: one pass over two tokens a sequence
        (the catch-up after a verification: the last accepted token and the bonus), then one
        over one token a sequence per further depth."""
        c = self.calibration.get(method)
        if not c:
            return None
        return c(2 * batch) + (depth - 1) * c(batch)

    def calibrate(self, method: str, run_pass: Callable[[int], None], max_rows: int,
                  cache: Path | None = None) -> dict[int, float]:
        """Measure (or load from `cache`) a model drafter's own pass (a draft model's) up to
        `max_rows` rows, so that what its proposals cost is known before it first proposes:
        without it, a batch on a machine where drafting cannot pay (a CPU verifying many rows)
        drafts until the measurements come in, and a short request pays the draft model's
        catch-up over its prompt."""
        curve = measure_curve(run_pass, max_rows, cache)
        c = self.calibration[method] = Curve(proportional=True)
        for r, sec in curve.items():
            c.record(r, sec)
        return curve
