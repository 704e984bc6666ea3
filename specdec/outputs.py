"""What the engine hands back: per-request outputs and speculation metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Speculation counters of one request (or of the whole engine, per method).

    tau counts the bonus token: plain decoding has tau 1.0."""

    method: str = "none"
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    emitted_tokens: int = 0
    rejected_steps: int = 0  # verifications that stopped before the end of the draft
    accepted_per_position: list[int] = field(default_factory=list)
    # verifications that offered a token at draft depth i (a tree counts once per depth)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.emitted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def record(self, num_draft: int, accepted_depth: int, emitted: int,
               draft_depth: int | None = None) -> None:
        if accepted_depth < (num_draft if draft_depth is None else draft_depth):
            self.rejected_steps += 1
        self.steps += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += accepted_depth
        self.emitted_tokens += emitted
        depth = num_draft if draft_depth is None else draft_depth
        for counts, n in ((self.accepted_per_position, accepted_depth),
                          (self.drafted_per_position, depth)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def to_dict(self) -> dict:
        return {"method": self.method, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "steps": self.steps,
                "tau": round(self.tau, 4), "acceptance_rate": round(self.acceptance_rate, 4),
                "accepted_per_position": list(self.accepted_per_position),
                "drafted_per_position": list(self.drafted_per_position)}


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # for the delta tokens
    spec: SpecMetrics | None = None
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    stop_reason: str | int | None = None  # see Sequence.stop_reason
    error: str | None = None  # finish reason "error": what failed (Request.fail)


@dataclass
class ControlStats:
    """Per drafter: chosen depths, and the tokens the controller predicted against those the
    verifications emitted (over the steps that drafted with it). Its choices only: a
    request's fixed k is not counted."""

    depths: Counter = field(default_factory=Counter)
    predicted_tokens: float = 0.0
    emitted_tokens: int = 0
    steps: int = 0

    def to_dict(self) -> dict:
        return {"depth_histogram": {str(k): v for k, v in sorted(self.depths.items())},
                "predicted_tokens": round(self.predicted_tokens, 3),
                "emitted_tokens": self.emitted_tokens, "steps": self.steps}
