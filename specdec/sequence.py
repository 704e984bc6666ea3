"""A request's token state as the scheduler and block manager see it: ints and lists only."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # KV state: the first num_computed tokens have their KV in the cache. A running sequence
    # in decode has num_computed == len(tokens) - 1: its last token is written next step.
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    finish_reason: str | None = None
    # What a "stop" finish stopped on: the stop string, the text a rule stopped on
    # (specdec/stop_rules.py) or the stop token id; None for EOS. "budget" or "n_indent" for a
    # "length" finish by those rules.
    stop_reason: str | int | None = None
    aborted: bool = False
    first_token_time: float | None = None
    # Speculation chosen for this request: drafter method and settings (resolved by the engine).
    spec_method: str = "none"
    spec_k: int = 0
    spec_options: dict = field(default_factory=dict)

    # prompt + output as one list, extended as the output grows (`tokens`).
    _joined: list[int] = field(default_factory=list, repr=False, compare=False)
    _joined_from: tuple = field(default=(), repr=False, compare=False)  # (prompt, output) lists

    @property
    def tokens(self) -> list[int]:
        """The prompt and the output as one list, for reading only: it is kept and extended as
        the output grows rather than rebuilt on each call (a speculative step asks for every
        drafting sequence's tokens, a thousand or more each at long contexts). Rebuilt when the
        prompt or output list is replaced (the output only ever grows in place)."""
        p, o, j = self.prompt_token_ids, self.output_token_ids, self._joined
        n = len(p)
        src = self._joined_from
        if not src or src[0] is not p or src[1] is not o or not n <= len(j) <= n + len(o):
            j = self._joined = p + o
            self._joined_from = (p, o)
        elif len(j) < n + len(o):
            j += o[len(j) - n:]
        return j

    @property
    def last_token(self) -> int:
        """tokens[-1] without building the whole token list."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs its KV computed."""
        return self.num_uncomputed > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
