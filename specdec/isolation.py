"""Pinning a failed engine step on the request that caused it, so that it alone fails.

Work done for one request that raises inside a step (its drafter's proposal, the commit of its
row) is pinned on it there (specdec/drafting.py, specdec/commit.py). What raises out of a step
names no request: the target's pass, or sampling the whole batch at once. `isolate` then runs
the suspects apart: it retries the step with half of them (the rest held, keeping their place
and their blocks) and keeps the half that still fails, down to one request that fails alone;
that one is failed, and everyone else goes on. The retries are real steps: the requests in a
half that passes move on, and their outputs are returned.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

log = logging.getLogger("specdec.engine")


class Isolatable(Protocol):
    """What `isolate` needs of an engine (LLMEngine has it)."""

    @property
    def request_ids(self) -> list[str]: ...

    def step(self) -> list[Any]: ...

    def run_only(self, request_ids: set[str] | None) -> None: ...

    def fail_request(self, request_id: str, message: str) -> None: ...


def isolate(engine: Isolatable, error: BaseException) -> tuple[list[Any], str | None]:
    """After `engine.step()` raised `error`: the outputs of the steps taken meanwhile, and the
    request found to fail alone (now failed), or None when none did (the fault went away, or
    needs several requests together)."""
    outputs: list[Any] = []

    def passes(ids: list[str]) -> bool:
        engine.run_only(set(ids))
        try:
            outputs.extend(engine.step())
            # With overlap on, a step is committed by the next call: run it with nobody so
            # that what `ids` launched is read back (a no-op otherwise).
            engine.run_only(set())
            outputs.extend(engine.step())
        except Exception as exc:  # any failure narrows the search
            nonlocal error
            error = exc
            return False
        return True

    try:
        suspects = engine.request_ids
        while len(suspects) > 1:
            half = suspects[:len(suspects) // 2]
            rest = suspects[len(half):]
            suspects = half if not passes(half) else rest
            live = set(engine.request_ids)
            suspects = [rid for rid in suspects if rid in live]
        culprit = suspects[0] if suspects and not passes(suspects) else None
    finally:
        engine.run_only(None)
    if culprit is not None:
        log.error("request %s fails the engine step alone: %s", culprit, error)
        engine.fail_request(culprit, f"engine error: {error}")
    return outputs, culprit
