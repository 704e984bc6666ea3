"""Per-request sampling settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler.

    temperature 0 means greedy. `speculative` is the same plain dict the HTTP API takes:
    `{"method": "ngram" | "draft_model" | "none", "num_speculative_tokens": k, ...}`;
    None means "use the engine's default".
    """

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    # Temperature after top-k, top-p and min-p (llama.cpp's default order) instead of before.
    temperature_last: bool = False
    # llama.cpp's `infill` sampler after the filters (specdec/sampler.py, `infill_filter`); its
    # end-of-generation tokens are stop_token_ids and the model's EOS.
    infill: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-n logprobs per output token; None: off
    skip_special_tokens: bool = True
    # Code completion (specdec/stop_rules.py): llama.cpp's n_indent and t_max_predict_ms, and
    # FIM's stop where the output repeats the start of the suffix.
    n_indent: int = 0  # 0: off
    max_predict_ms: float | None = None  # from the first output token; None: no budget
    fim_suffix: str | None = None
    fim_line_start: bool = False  # the cursor (the output's start) is at a line start
    # False: the prompt is computed in full, not read from the prefix cache (llama.cpp's
    # cache_prompt; outputs are the same either way, only the time differs).
    cache_prompt: bool = True
    speculative: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check("temperature", self.temperature >= 0.0, "must be >= 0")
        self._check("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        self._check("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (off) or >= 0")
        self._check("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        self._check("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0")
        self._check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
                    "must be in [-2, 2]")
        self._check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
                    "must be in [-2, 2]")
        self._check("max_tokens", self.max_tokens >= 1, "must be >= 1")
        self._check("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
                    "must be in [0, max_tokens]")
        self._check("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
                    "must be in [0, 20]")
        self._check("n_indent", self.n_indent >= 0, "must be >= 0")
        self._check("max_predict_ms", self.max_predict_ms is None or self.max_predict_ms > 0,
                    "must be > 0")
        self._check("stop", all(isinstance(s, str) and s for s in self.stop),
                    "must be non-empty strings")
        if self.speculative is not None and not isinstance(self.speculative, dict):
            raise ValueError("speculative must be a dict such as {'method': 'ngram'}")

    @staticmethod
    def _check(name: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{name} {what}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
