"""The drafter interface and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from drafters.tree import DraftTree
from specdec.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """One speculating sequence, as a drafter sees it in a step."""

    request_id: str
    tokens: list[int]  # prompt + output; the last one is the tree's root
    max_nodes: int  # the largest tree the step can verify for it
    k: int  # the request's num_speculative_tokens (depth)
    options: dict[str, Any] = field(default_factory=dict)
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None  # the request's own RNG for drafter sampling


@dataclass(frozen=True)
class Option:
    """A per-request speculative option: its type and, for numbers, its bounds (every size a
    request may set has one, so no request can make a step's work unbounded)."""

    kind: type
    lo: float | None = None
    hi: float | None = None

    def check(self, key: str, v: Any) -> None:
        if isinstance(v, bool) and self.kind is not bool:
            ok = False  # True is an int to Python, not to a client
        else:
            ok = isinstance(v, (int, float) if self.kind is float else self.kind)
        if not ok:
            raise ValueError(f"speculative.{key} must be {_KIND_NAMES[self.kind]}, got "
                             f"{type(v).__name__}")
        if self.lo is not None and not self.lo <= v <= self.hi:
            raise ValueError(f"speculative.{key} must be in [{self.lo:g}, {self.hi:g}], got {v}")


_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               dict: "an object"}
MAX_DRAFT_TOKENS = 64
# Options every method takes (the engine reads them).
COMMON_OPTIONS = {"method": Option(str), "num_speculative_tokens": Option(int, 0, MAX_DRAFT_TOKENS),
                  "adaptive": Option(bool)}


# What `"method": "auto"` chooses between, per sequence and step (specdec/spec_control.py): the
# drafters that need nothing from the target but its tokens, so one not chosen stays current.
AUTO_DRAFTERS = ("ngram", "draft_model")


def check_speculative(spec: dict[str, Any]) -> None:
    """Raise ValueError (naming the key) unless `spec` is a valid speculative dict: a known
    method, and only the keys that method takes, each of its type and within its bounds."""
    method = spec.get("method", "ngram")
    if not isinstance(method, str):
        raise ValueError("speculative.method must be a string")
    known = dict(COMMON_OPTIONS)
    if method == "auto":
        for m in AUTO_DRAFTERS:
            known.update(drafter_class(m).options)
    elif method != "none":
        known.update(drafter_class(method).options)
    for key, v in spec.items():
        opt = known.get(key)
        if opt is None:
            raise ValueError(f"speculative.{key} is not an option of method {method!r} (it "
                             f"takes {', '.join(sorted(known))})")
        opt.check(key, v)
    min_n = spec.get("min_n", 1)
    if min_n > spec.get("max_n", max(min_n, 3)):  # checked when both are given
        raise ValueError("speculative.min_n must not exceed speculative.max_n")
    if method not in ("none", "auto"):
        drafter_class(method).check_options(spec)


class Drafter(ABC):
    """Proposes draft trees; learns afterwards what the target accepted.

    Capabilities are fields: `needs_hidden_states` (consumes target hidden states),
    `proposes_by_lookup` (a lookup, no model: free, and sometimes it finds nothing).
    `options`: the per-request options it reads (`check_speculative`)."""

    name: ClassVar[str]
    options: ClassVar[dict[str, Option]] = {}
    needs_hidden_states: ClassVar[bool] = False
    # Proposes by looking the context up (no model): free, but it may find nothing to propose.
    proposes_by_lookup: ClassVar[bool] = False
    # Tokens the last proposal fed before its first draft (a draft model catching up after
    # steps without it; a lookup indexing a new request's prompt); the speculation controller
    # does not time such proposals.
    last_catch_up: int = 1
    # A model drafter that may stop a chain short by its own judgement (a draft model's
    # `p_min`: the token it is unsure of is the chain's last, so every pass drafts one); it
    # then reports, per request of its last proposal, the depth it was asked for (a lookup's
    # short tree found nothing, at no cost).
    stops_short: ClassVar[bool] = False
    last_asked: list[int] | None = None

    @abstractmethod
    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        """A tree per request, in batch order, each with at most `max_nodes` nodes."""

    def accepted(self, request_id: str, num_tokens: int, tokens: list[int]) -> None:
        """The request now has `num_tokens` tokens, ending with `tokens` (accepted path plus
        the bonus token), so stateful drafters can roll back what the target rejected."""

    # Drafters with needs_hidden_states: the target layers whose residual streams they consume
    # (the final normed hidden state always comes too).
    capture_layers: tuple[int, ...] = ()

    def observe(self, request_id: str, start: int, tokens: list[int],
                features: torch.Tensor) -> None:
        """Target features of committed positions start .. start + len(tokens) - 1, whose input
        tokens were `tokens` ([n, (len(capture_layers) + 1) * hidden]). Called after every
        prefill chunk and, for decodes, for the root and the accepted nodes."""

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop any state held for it."""

    @classmethod
    def check_options(cls, spec: dict[str, Any]) -> None:
        """Checks of this drafter's options beyond their types and bounds (ValueError)."""

    def max_nodes(self, k: int, options: dict[str, Any]) -> int:
        """The tree size this drafter asks the scheduler for, given the request's settings."""
        return k

    def catch_up_tokens(self, behind: int, options: dict[str, Any]) -> int:
        """Tokens its next proposal feeds for a sequence it has not seen the last `behind`
        tokens of (a model drafter; a new request's are its whole prompt)."""
        return behind

    def has_position_table(self, options: dict[str, Any]) -> bool:
        """Whether, with these settings, the drafter's trees depend on positions alone
        (`position_table`), so steps can be drafted on the device (specdec/chaining.py)."""
        return False

    def has_device_lookup(self, options: dict[str, Any]) -> bool:
        """Whether, with these settings, the drafter's trees are prompt-lookup chains of k tokens
        that `specdec.device_drafts.lookup` computes on the device from the sequence's tokens
        (the n-gram drafter with `on_device`)."""
        return False

    def position_table(self, request: DraftRequest, length: int,
                       device: torch.device) -> torch.Tensor:
        """[length] or [length, W] int64 on `device`: entry [p, j] is the token this drafter
        proposes at position p for a node that is its parent's child j (in sibling order),
        whatever the step; siblings must differ. Only where `has_position_table` says so."""
        raise NotImplementedError(f"drafter {self.name!r} has no position table")


DRAFTERS: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    DRAFTERS[cls.name] = cls
    return cls


def drafter_class(method: str) -> type[Drafter]:
    if method not in DRAFTERS:
        raise ValueError(f"unknown speculative method {method!r}; "
                         f"choose one of: none, {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[method]
