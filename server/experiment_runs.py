"""An assigned request's path through the server: its arm's speculation goes in, and once its
choices end, its record (with the TTFT and TPOT the server saw) goes to the experiment store.

The streams of an assigned request are wrapped in `TrackedStream`, so the generation code that
merges, streams and collects them is the same whether or not a request is in an experiment.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from experiments.manager import Assignment, ExperimentManager
from server.metrics import ServerMetrics

log = logging.getLogger("specdec.server")
ARM_HEADER = "X-Specdec-Arm"
KEY_HEADER = "x-experiment-key"


class ExperimentRun:
    """Times one assigned request (all its choices) from its arrival at the server, and writes
    its record exactly once: when its last choice finishes, or when it is aborted or fails."""

    def __init__(self, manager: ExperimentManager, assignment: Assignment, request_id: str,
                 n_prompt: int, n: int, arrival: float, metrics: ServerMetrics | None) -> None:
        self.manager = manager
        self.assignment = assignment
        self.request_id = request_id
        self.n_prompt = n_prompt
        self.arrival = arrival  # time.monotonic() when the request reached the server
        self.metrics = metrics
        self.first: float | None = None
        self.last: list[Any] = [None] * n
        self.finished = [False] * n
        self.done = False

    def seen(self, index: int, out: Any) -> None:
        if self.first is None and out.delta_token_ids:
            self.first = time.monotonic()
        self.last[index] = out
        if out.finished:
            self.finished[index] = True
            if all(self.finished):
                reasons = {o.finish_reason for o in self.last}
                self.end(reasons.pop() if len(reasons) == 1 else "mixed")

    def end(self, finish_reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        outs = [o for o in self.last if o is not None]
        ttft = None if self.first is None else self.first - self.arrival
        longest = max((len(o.token_ids) for o in outs), default=0)
        # TPOT: after the first token, over the longest choice (choices decode side by side).
        tpot = (now - self.first) / (longest - 1) if self.first is not None and longest > 1 \
            else None
        try:
            rec = self.manager.finish(self.assignment, request_id=self.request_id,
                                      prompt_tokens=self.n_prompt, outputs=outs, ttft_s=ttft,
                                      tpot_s=tpot, finish_reason=finish_reason)
            if self.metrics is not None:
                self.metrics.observe_experiment(rec.experiment, rec.arm, rec.output_tokens,
                                                rec.draft_tokens, rec.accepted_tokens,
                                                rec.ttft_s, rec.tpot_s)
        except Exception:  # the response must not fail for its record's sake
            log.exception("experiment record of %s", self.request_id)


class TrackedStream:
    """A RequestStream that tells its ExperimentRun what it yields and how it ended."""

    def __init__(self, inner: Any, run: ExperimentRun, index: int) -> None:
        self.inner = inner
        self.run = run
        self.index = index

    @property
    def request_id(self) -> str:
        return str(self.inner.request_id)

    @property
    def finished(self) -> bool:
        return bool(self.inner.finished)

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            async for out in self.inner:
                self.run.seen(self.index, out)
                yield out
        except Exception:
            self.run.end("error")
            raise
        finally:
            if not self.run.finished[self.index]:
                self.run.end("abort")

    def abort(self) -> None:
        if not self.run.finished[self.index]:
            self.run.end("abort")
        self.inner.abort()


def track(manager: ExperimentManager, assignment: Assignment, request_id: str, n_prompt: int,
          arrival: float, streams: list[Any], metrics: ServerMetrics | None) -> list[Any]:
    run = ExperimentRun(manager, assignment, request_id, n_prompt, len(streams), arrival,
                        metrics)
    return [TrackedStream(s, run, i) for i, s in enumerate(streams)]


def open_experiments(file: str | None, db: str | None) -> ExperimentManager | None:
    """`specdec serve --experiments FILE --experiments-db DB`: the file's experiments and those
    the database holds. DB defaults to $SPECDEC_EXPERIMENTS_DB, else experiments.sqlite in the
    model cache (":memory:" keeps nothing: the tests' servers use it). A bad file, or a database
    that cannot be opened when either flag was given, is an error; without flags the server
    then runs without experiments, and says so."""
    from experiments.config import load_experiments
    from specdec.hub import cache_root

    declared = load_experiments(file) if file else []
    path = db or os.environ.get("SPECDEC_EXPERIMENTS_DB") or str(
        cache_root() / "experiments.sqlite")
    try:
        return ExperimentManager.open(path, declared)
    except Exception as exc:  # sqlite3.Error, OSError
        if file or db:
            raise ValueError(f"--experiments-db {path}: {exc}") from exc
        log.warning("experiments are off: cannot open %s: %s", path, exc)
        return None
