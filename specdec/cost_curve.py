"""A cost by size (query rows, or draft depth) from recent measurements: what
specdec/cost_model.py's curves are made of."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

WINDOW = 16  # recent measurements kept per row count


def lower_median(xs: Iterable[float]) -> float:
    """The median of a window, the lower of the middle two where they are two."""
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


class Curve:
    """Seconds by a size (query rows, or draft depth): the fastest (or the median, `typical`)
    of the recent WINDOW measurements per size, linear between measured sizes; below the
    smallest, proportional to it; past the largest, growing with the slope of the two largest
    (one point: proportional when `proportional`, else flat)."""

    def __init__(self, proportional: bool = False, typical: bool = False) -> None:
        self.proportional = proportional
        self.typical = typical  # the median of the window, not its fastest
        self._window: dict[int, deque[float]] = {}
        self._sizes: list[int] = []  # sorted sizes with a measurement
        self.best: dict[int, float] = {}

    def record(self, size: int, seconds: float) -> None:
        window = self._window.get(size)
        if window is None:
            window = self._window[size] = deque(maxlen=WINDOW)
            bisect.insort(self._sizes, size)
        window.append(seconds)
        self.best[size] = lower_median(window) if self.typical else min(window)

    def __bool__(self) -> bool:
        return bool(self._sizes)

    @property
    def sizes(self) -> list[int]:
        return self._sizes

    def __call__(self, size: int) -> float:
        xs, best = self._sizes, self.best
        if not xs:
            return 0.0
        if size in best:
            return best[size]
        i = bisect.bisect(xs, size)
        if i == 0:
            return best[xs[0]] * size / xs[0]
        lo = xs[i - 1]
        if i < len(xs):
            hi = xs[i]
            return best[lo] + (size - lo) / (hi - lo) * (best[hi] - best[lo])
        if len(xs) == 1:
            return best[lo] * size / lo if self.proportional else best[lo]
        prev = xs[-2]
        slope = max(0.0, (best[lo] - best[prev]) / (lo - prev))
        return best[lo] + slope * (size - lo)
