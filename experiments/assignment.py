"""Which arm a request runs: sticky hashing for design "request", time slots for "switchback".

Both are pure functions of their inputs (a SHA-256 of names and keys, never Python's salted
`hash` or a process RNG), so a key lands in the same arm and a time in the same slot after a
restart, on any machine.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from experiments.config import Experiment

_SCALE = float(1 << 64)


def _uniform(*parts: str) -> float:
    """A stable uniform draw in [0, 1) from the parts (joined by NUL, which no name holds)."""
    digest = hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def unit_fraction(experiment: str, unit: str) -> float:
    return _uniform(experiment, unit)


def arm_for_fraction(arms: tuple[str, ...], weights: dict[str, float], u: float) -> str:
    """The arm whose cumulative-weight interval holds u."""
    acc = 0.0
    for arm in arms:
        acc += weights[arm]
        if u < acc:
            return arm
    return arms[-1]  # u within rounding of 1.0


def assign_arm(exp: Experiment, unit: str) -> str:
    """The arm of `unit` under design "request": the same unit always gets the same arm."""
    return arm_for_fraction(exp.arm_names, exp.weights, unit_fraction(exp.name, unit))


@dataclass(frozen=True)
class SwitchbackSchedule:
    """Slot i covers [start + i * slot_seconds, start + (i + 1) * slot_seconds). Slots come in
    blocks of len(arms), each block a seeded random permutation of the arms: every arm gets the
    same number of slots within one block of any time, and the order cannot line up with a
    daily or hourly cycle of the traffic."""

    seed: str
    arms: tuple[str, ...]
    start: float
    slot_seconds: float
    burn_in_seconds: float

    @classmethod
    def of(cls, exp: Experiment) -> SwitchbackSchedule:
        if exp.started_at is None:
            raise ValueError(f"experiment {exp.name!r} has not started")
        return cls(f"{exp.name}\x00{exp.started_at!r}", exp.arm_names, exp.started_at,
                   exp.slot_seconds, exp.burn_in_seconds)

    def block(self, b: int) -> list[str]:
        """Block b's arm order: a Fisher-Yates shuffle driven by stable hashes."""
        order = list(self.arms)
        for j in range(len(order) - 1, 0, -1):
            r = min(int(_uniform(self.seed, str(b), str(j)) * (j + 1)), j)
            order[j], order[r] = order[r], order[j]
        return order

    def arm(self, slot: int) -> str:
        n = len(self.arms)
        return self.block(slot // n)[slot % n]

    def slot(self, t: float) -> int:
        return max(0, math.floor((t - self.start) / self.slot_seconds))

    def slot_start(self, slot: int) -> float:
        return self.start + slot * self.slot_seconds

    def in_burn_in(self, t: float) -> bool:
        """Whether t falls in the first burn_in_seconds of its slot."""
        return t - self.slot_start(self.slot(t)) < self.burn_in_seconds

    def excluded(self, slot: int, started: float, finished: float) -> bool:
        """Whether a request assigned in `slot` is kept out of the statistics: it started in
        the slot's burn-in (requests of the previous arm still shared its batches) or it ran
        on past the slot's end (into the next arm's)."""
        lo = self.slot_start(slot) + self.burn_in_seconds
        hi = self.slot_start(slot + 1)
        return not (lo <= started and finished < hi)
