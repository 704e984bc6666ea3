"""What one finished request of an experiment contributes: the row the store appends and the
statistics read. Latency fields are None where the request produced no token."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    experiment: str
    arm: str
    unit: str                 # the assignment key: user, X-Experiment-Key or the request id
    request_id: str
    slot: int | None          # switchback slot index; None under design "request"
    in_burn_in: bool          # switchback: finished inside its slot's burn-in (excluded)
    finished_at: float        # unix seconds
    prompt_tokens: int
    output_tokens: int
    draft_tokens: int         # drafted tokens offered to verification
    accepted_tokens: int      # of those, accepted
    steps: int                # verification steps (plain decode steps count for arm "none")
    accepted_per_position: list[int] = field(default_factory=list)  # [depth] accepted counts
    drafted_per_position: list[int] = field(default_factory=list)   # [depth] offered counts
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time per output token after the first
    finish_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
