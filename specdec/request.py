"""A request as the engine holds it: its sequence, speculation choice, RNG, detokenizer, metrics.

The scheduler and the block manager see only the `Sequence` (ints and lists); everything else a
request needs from admission to its last output lives here, in one record per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec.detokenizer import IncrementalDetokenizer
from specdec.outputs import SpecMetrics
from specdec.sequence import Sequence

if TYPE_CHECKING:
    from drafters.base import Drafter


@dataclass(frozen=True)
class Speculation:
    """How a request speculates, resolved and checked at admission (specdec/drafting.py)."""

    method: str = "none"  # "none" or a registered drafter's name
    k: int = 0  # num_speculative_tokens: the draft depth asked for
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    adaptive: bool = False  # the engine may shrink k, down to plain decoding (spec_control)
    # "auto": the drafters the controller chooses between, per step (each a Speculation)
    alternatives: tuple[Speculation, ...] = field(default=(), hash=False, compare=False)

    @property
    def on(self) -> bool:
        return self.method != "none"

    @property
    def source(self) -> str | None:
        """What the drafter is built from, as the options name it: the draft model or the
        EAGLE head; None for drafters built from nothing but the method."""
        if self.method == "draft_model":
            return self.options.get("draft_model")
        if self.method == "eagle":
            return self.options.get("eagle_head")
        return None

    @property
    def drafter_key(self) -> tuple[str, str | None]:
        """Everything that selects a drafter instance: requests with one key share one."""
        return self.method, self.source


NO_SPECULATION = Speculation()


@dataclass
class Request:
    seq: Sequence
    spec: Speculation
    generator: torch.Generator  # the request's own draws: sampling and drafting
    detok: IncrementalDetokenizer
    metrics: SpecMetrics | None  # None when the request does not speculate
    drafter: Drafter | None = None  # its spec's drafter instance (Drafting.drafter); None: none
    depth: int = 0  # this step's draft depth (the request's k or the controller's choice)
    active: Speculation | None = None  # this step's drafter's speculation (auto: one of them)
    fallback: tuple[Speculation, int] | None = None  # (drafter, depth) if the lookup finds none
    error: str | None = None  # why the request failed (`fail`); None while it has not

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def fail(self, message: str) -> None:
        """Work done for this request alone raised: it ends at the next step with finish reason
        "error" and `message`, and the other requests of the batch go on."""
        if self.error is None:
            self.error = message
        self.seq.aborted = True


def prompt_ids(tokenizer: Any, prompt: str | list[int], vocab: int, max_model_len: int,
               kv_tokens: int) -> list[int]:
    """A prompt's token ids (a string is encoded without special tokens), or ValueError where
    the engine could not serve it: empty, ids outside the vocabulary, no room for a completion
    in the context, or more tokens than the KV cache holds."""
    ids = (tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str)
           else [int(t) for t in prompt])
    if not ids:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is "
                         f"{max_model_len} tokens, including the completion")
    if len(ids) + 1 > kv_tokens:
        raise ValueError(f"the prompt needs more KV cache ({len(ids)} tokens) than the "
                         f"engine has ({kv_tokens} tokens)")
    return ids
