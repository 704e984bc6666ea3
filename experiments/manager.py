"""The live side of experiments: which experiments run, which arm a request gets, and the
record each assigned request leaves in the store.

Definitions are saved in the store as they change (created, paused, resumed, stopped), so a
restart resumes every experiment that was not stopped, in the state it was left in. Records are
appended on one background thread: the event loop only builds the record and queues it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.assignment import SwitchbackSchedule, assign_arm
from experiments.config import Experiment, parse_experiment
from experiments.record import RequestRecord
from experiments.stats import confidence_sequence_history, slot_seconds_of, summarize
from experiments.store import RecordStore

log = logging.getLogger("specdec.experiments")
MAX_UNIT_CHARS = 128


class ExperimentExistsError(Exception):
    """An experiment of that name exists (stopped ones too: a name is never reused)."""


class UnknownExperimentError(Exception):
    """No experiment of that name."""


class StateChangeError(Exception):
    """The state change is not allowed (a stopped experiment stays stopped)."""


@dataclass(frozen=True)
class Assignment:
    """An assigned request: its experiment, arm and unit, and the arm's speculation."""

    experiment: str
    arm: str
    unit: str
    speculative: dict[str, Any]
    slot: int | None  # switchback slot; None under design "request"
    started: float  # unix seconds at assignment

    @property
    def header(self) -> str:
        return f"{self.experiment}/{self.arm}"

    @property
    def tags(self) -> dict[str, str]:
        return {"experiment": self.experiment, "arm": self.arm}


def unit_key(user: str | None, key: str | None, request_id: str) -> str:
    """The unit: the request's `user`, else its X-Experiment-Key, else the request itself. A
    long key is kept as its hash, so that a client cannot bloat every record it leaves."""
    unit = user or key or request_id
    if len(unit) > MAX_UNIT_CHARS:
        unit = "sha256:" + hashlib.sha256(unit.encode("utf-8", "surrogatepass")).hexdigest()
    return unit


def merge_definitions(stored: dict[str, Experiment],
                      declared: Iterable[Experiment]) -> dict[str, Experiment]:
    """Experiments from the store, with those from a file added. One in both keeps its stored
    state and start (a paused or stopped one stays so); one whose arms, weights or design
    differ from what was recorded is an error, since its records must not be pooled."""
    out = dict(stored)
    for e in declared:
        old = stored.get(e.name)
        if old is None:
            out[e.name] = e
        elif not old.same_design(e):
            raise ValueError(f"experiments: {e.name!r} differs from the experiment of that name "
                             "in the experiments database (arms, control, weights or design): "
                             "give the changed experiment a new name")
    return out


class ExperimentManager:
    """Holds the experiments and the store. `assign` and `finish` run on the event loop and
    never wait for the disk; the rest may block briefly (call them off the loop)."""

    def __init__(self, store: RecordStore, declared: Iterable[Experiment] = (), *,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._lock = threading.Lock()
        # One writer thread: appends keep their order, and `flush` waits for all before it.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="specdec-experiments")
        stored: dict[str, Experiment] = {}
        for name in store.experiments():
            d = store.experiment(name)
            if d is None:  # records without a definition (e.g. written by `specdec ab run`)
                continue
            try:
                stored[name] = parse_experiment(d, f"experiments database: {name}")
            except ValueError as exc:
                log.warning("skipping experiment %r from the database: %s", name, exc)
        now = self.clock()
        self._experiments = {n: e.started(now)
                             for n, e in merge_definitions(stored, declared).items()}
        self._schedules: dict[str, SwitchbackSchedule] = {}
        for e in self._experiments.values():
            if stored.get(e.name) != e:
                store.save_experiment(e.name, e.to_dict())

    @classmethod
    def open(cls, db: str | Path, declared: Iterable[Experiment] = ()) -> ExperimentManager:
        return cls(RecordStore(db), declared)

    # ---- reading ---------------------------------------------------------------------------

    def experiments(self) -> list[Experiment]:
        return [self._experiments[n] for n in sorted(self._experiments)]

    def get(self, name: str) -> Experiment:
        e = self._experiments.get(name)
        if e is None:
            raise UnknownExperimentError(f"no experiment named {name!r}")
        return e

    def current(self) -> Experiment | None:
        """The experiment that assigns requests: of the active ones, the first by name (one
        request can only run one speculation)."""
        return next((e for e in self.experiments() if e.active), None)

    # ---- assignment (event loop) -----------------------------------------------------------

    def assign(self, request_id: str, user: str | None = None,
               key: str | None = None) -> Assignment | None:
        """The arm of a request that chose no speculation itself; None when no experiment is
        active."""
        exp = self.current()
        if exp is None:
            return None
        now = self.clock()
        unit = unit_key(user, key, request_id)
        if exp.design == "switchback":
            sched = self._schedule(exp)
            slot: int | None = sched.slot(now)
            arm = sched.arm(slot)
        else:
            slot, arm = None, assign_arm(exp, unit)
        return Assignment(exp.name, arm, unit, dict(exp.arms[arm]), slot, now)

    def _schedule(self, exp: Experiment) -> SwitchbackSchedule:
        sched = self._schedules.get(exp.name)
        if sched is None:
            sched = self._schedules[exp.name] = SwitchbackSchedule.of(exp)
        return sched

    def finish(self, a: Assignment, *, request_id: str, prompt_tokens: int,
               outputs: list[Any], ttft_s: float | None, tpot_s: float | None,
               finish_reason: str | None) -> RequestRecord:
        """Build the request's record from its choices' last outputs and queue its append."""
        now = self.clock()
        specs = [s for s in (getattr(o, "spec", None) for o in outputs)
                 if s is not None and getattr(s, "method", "none") != "none"]
        output_tokens = sum(len(getattr(o, "token_ids", ()) or ()) for o in outputs)
        accepted = _sum_positions(specs, "accepted_per_position")
        drafted = _sum_positions(specs, "drafted_per_position")
        excluded = False
        if a.slot is not None:
            excluded = self._schedule(self.get(a.experiment)).excluded(a.slot, a.started, now)
        record = RequestRecord(
            experiment=a.experiment, arm=a.arm, unit=a.unit, request_id=request_id,
            slot=a.slot, in_burn_in=excluded, finished_at=now, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            draft_tokens=sum(int(s.draft_tokens) for s in specs),
            accepted_tokens=sum(int(s.accepted_tokens) for s in specs),
            # Without speculation every step emits one token.
            steps=sum(int(s.steps) for s in specs) if specs else output_tokens,
            accepted_per_position=accepted, drafted_per_position=drafted,
            ttft_s=ttft_s, tpot_s=tpot_s, finish_reason=finish_reason)
        self._writer.submit(self._append, record)
        return record

    def _append(self, record: RequestRecord) -> None:
        try:
            self.store.append(record)
        except Exception:  # a full disk must not fail the requests themselves
            log.exception("could not store the record of %s", record.request_id)

    def flush(self) -> None:
        """Wait until every queued record is stored."""
        self._writer.submit(lambda: None).result()

    # ---- administration (blocking: call off the event loop) --------------------------------

    def create(self, definition: Any) -> Experiment:
        """Add an experiment from an admin call's body. Raises ValueError naming the field,
        or ExperimentExistsError."""
        exp = parse_experiment(definition).started(self.clock())
        with self._lock:
            if exp.name in self._experiments or self.store.experiment(exp.name) is not None:
                raise ExperimentExistsError(f"an experiment named {exp.name!r} exists "
                                            "(names are never reused: choose another)")
            self.store.save_experiment(exp.name, exp.to_dict())
            self._experiments[exp.name] = exp
        return exp

    def set_state(self, name: str, state: str) -> Experiment:
        with self._lock:
            exp = self.get(name)
            if exp.state == "stopped" and state != "stopped":
                raise StateChangeError(f"experiment {name!r} is stopped; a stopped experiment "
                                       "stays stopped (create a new one)")
            new = exp.with_state(state)
            if new != exp:
                self.store.save_experiment(name, new.to_dict())
                self._experiments[name] = new
        return new

    def records(self, name: str) -> list[RequestRecord]:
        self.get(name)
        self.flush()  # so that a request answered before this call is in the answer
        return self.store.records(name)

    def summary(self, name: str, *, alpha: float = 0.05, mde: float = 0.05,
                history_points: int = 100) -> dict[str, Any]:
        """The statistics over the experiment's records, and for each arm against the control
        the lifts' confidence sequences over time (`history`)."""
        exp = self.get(name)
        records = self.records(name)
        out = summarize(records, control=exp.control, arms=list(exp.arm_names),
                        weights=exp.weights, design=exp.design, alpha=alpha, mde=mde,
                        slot_seconds=slot_seconds_of(exp.to_dict()))
        out["history"] = {
            arm: {m: confidence_sequence_history(records, exp.control, arm, m, alpha,
                                                 max_points=history_points)
                  for m in ("acceptance_rate", "tau")}
            for arm in exp.arm_names if arm != exp.control} if exp.design == "request" else {}
        return out

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()


def _sum_positions(specs: list[Any], attr: str) -> list[int]:
    out: list[int] = []
    for s in specs:
        for i, c in enumerate(getattr(s, attr, None) or ()):
            if i == len(out):
                out.append(0)
            out[i] += int(c)
    return out
