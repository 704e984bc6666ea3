"""What a step costs on this machine: the target pass by query rows, and each drafter's time per
unit of draft depth by batch size. The speculation controller (specdec/spec_control.py) plans
with it.

The pass curve is measured at start (`calibrate`: one eager pass per size of a grid of row
counts, the fastest of a few) and cached per machine, model, dtype, quantization and thread
count, so only the first start on a machine pays for it. Real steps then refine it online.

A shared machine only ever adds time to a step, so a cost is the fastest of its recent
measurements, not their mean: a few steps slowed by another process do not make speculation look
expensive, and a measurement older than WINDOW newer ones is forgotten. Between measured row
counts the cost is interpolated linearly, so a plan's cost never jumps where a bucket would
end; past the largest measured count it grows with the slope of the two largest (a larger pass
is never assumed cheaper than a smaller one).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

WINDOW = 16  # recent measurements kept per row count
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
CALIBRATION_PASSES = 3  # per row count, the fastest kept


class CostModel:
    def __init__(self) -> None:
        self._pass: dict[int, deque[float]] = {}  # query rows -> recent seconds
        self._rows: list[int] = []  # sorted row counts with a measurement
        self._best: dict[int, float] = {}  # rows -> fastest recent seconds
        self._draft: dict[tuple[str, int], deque[float]] = {}  # (method, batch) -> s / depth
        self.draft_best: dict[tuple[str, int], float] = {}

    # -- the target pass --------------------------------------------------------------------
    def record_pass(self, rows: int, seconds: float) -> None:
        window = self._pass.get(rows)
        if window is None:
            window = self._pass[rows] = deque(maxlen=WINDOW)
            bisect.insort(self._rows, rows)
        window.append(seconds)
        self._best[rows] = min(window)

    def knows(self, rows: int) -> bool:
        return rows in self._best

    @property
    def measured(self) -> dict[int, float]:
        return {r: self._best[r] for r in self._rows}

    def pass_time(self, rows: int) -> float:
        """Seconds of a target pass over `rows` query rows; 0.0 while nothing is measured."""
        xs = self._rows
        if not xs:
            return 0.0
        if rows in self._best:
            return self._best[rows]
        i = bisect.bisect(xs, rows)
        if i == 0:  # below the smallest measured count: no cheaper than nothing
            return self._best[xs[0]] * rows / xs[0]
        lo = xs[i - 1]
        if i < len(xs):
            hi = xs[i]
            f = (rows - lo) / (hi - lo)
            return self._best[lo] + f * (self._best[hi] - self._best[lo])
        if len(xs) == 1:  # one point: a larger pass is assumed to cost what it did (tried once)
            return self._best[lo]
        prev = xs[-2]
        slope = max(0.0, (self._best[lo] - self._best[prev]) / (lo - prev))
        return self._best[lo] + slope * (rows - lo)

    # -- drafters ---------------------------------------------------------------------------
    def record_draft(self, method: str, batch: int, depth: int, seconds: float) -> None:
        """A proposal for `batch` sequences, `depth` deep at most, took `seconds`."""
        if depth <= 0 or batch <= 0:
            return
        key = (method, batch)
        window = self._draft.setdefault(key, deque(maxlen=WINDOW))
        window.append(seconds / depth)
        self.draft_best[key] = min(window)

    def draft_time(self, method: str, batch: int) -> float:
        """Seconds per unit of depth of `method` drafting for `batch` sequences: measured at
        this batch size, else what the nearest measured size cost (0.0 when never measured):
        an estimate that errs low is tried, measured and corrected; one that errs high would
        never be tried."""
        if batch <= 0:
            return 0.0
        best = self.draft_best.get((method, batch))
        if best is not None:
            return best
        known = [b for (m, b) in self.draft_best if m == method]
        if not known:
            return 0.0
        return self.draft_best[(method, min(known, key=lambda b: (abs(b - batch), b)))]

    # -- calibration ------------------------------------------------------------------------
    def calibrate(self, run_pass: Callable[[int], None], max_rows: int,
                  cache: Path | None = None) -> dict[int, float]:
        """Measure (or load from `cache`) the pass curve up to `max_rows` rows. `run_pass(n)`
        runs one target pass of n query rows and returns when it is done."""
        rows = [r for r in CALIBRATION_ROWS if r <= max_rows]
        curve: dict[int, float] | None = None
        if cache is not None and cache.is_file():
            try:
                stored = json.loads(cache.read_text())
                curve = {int(r): float(s) for r, s in stored["pass_seconds"].items()}
            except (OSError, ValueError, KeyError, TypeError):
                curve = None
        if curve is None or not all(r in curve for r in rows):
            run_pass(1)  # warm-up: first-call allocations and kernel builds
            curve = {}
            for r in rows:
                best = float("inf")
                for _ in range(CALIBRATION_PASSES):
                    t = time.perf_counter()
                    run_pass(r)
                    best = min(best, time.perf_counter() - t)
                curve[r] = best
            if cache is not None:
                _write_atomic(cache, {"pass_seconds": {str(r): s for r, s in curve.items()},
                                      "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        for r in rows:
            self.record_pass(r, curve[r])
        return {r: curve[r] for r in rows}


def cache_file(root: Path, **key: object) -> Path:
    """Where a pass curve measured under `key` (machine, model, dtype, ...) is kept."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return root / f"pass_{digest[:16]}.json"


def machine_name() -> str:
    """The CPU's model name (what /proc/cpuinfo reports) and its core count."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name or 'unknown cpu'} x{os.cpu_count()}"


def _write_atomic(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only cache only costs the next start a calibration
        pass
