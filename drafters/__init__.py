"""Drafters propose draft trees; the target verifies them. Found by name in a registry."""

from __future__ import annotations

from typing import Any

from drafters import draft_model, eagle, ngram, replay  # noqa: F401  (registers the built-in drafters)
from drafters.base import (
    DRAFTERS,
    Drafter,
    DraftRequest,
    check_speculative,
    drafter_class,
    register,
)
from drafters.tree import DraftTree, chain


def create_drafter(method: str, **kw: Any) -> Drafter:
    """Instantiate a registered drafter; each takes the keyword arguments it needs."""
    return drafter_class(method)(**kw)


__all__ = ["DRAFTERS", "DraftRequest", "DraftTree", "Drafter", "chain", "check_speculative",
           "create_drafter", "drafter_class", "register"]
