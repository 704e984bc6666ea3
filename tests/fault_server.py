"""`python -m server` with faults a request can ask for (tests/test_faults.py):

- speculative method "faulty": n-gram drafting whose proposal raises once the request has
  `fail_at` tokens (a drafter bug that one request's state triggers);
- a request with seed 666 makes the batch's sampling raise (a sampler bug: it names no request,
  so the engine has to find it by running the step's requests apart).
"""

from __future__ import annotations

import sys
from typing import Any

import specdec.engine
from drafters import register
from drafters.base import DraftRequest, Option
from drafters.ngram import NgramDrafter
from drafters.tree import DraftTree

POISON_SEED = 666


@register
class FaultyDrafter(NgramDrafter):
    name = "faulty"
    options = {**NgramDrafter.options, "fail_at": Option(int, 0, 1 << 20)}

    def propose(self, batch: list[DraftRequest]) -> DraftTree:
        for r in batch:
            if len(r.tokens) >= r.options.get("fail_at", 1 << 30):
                raise RuntimeError(f"injected drafter fault at {len(r.tokens)} tokens")
        return super().propose(batch)


_verify_step = specdec.engine.verify_step


def faulty_verify_step(logits: Any, first: Any, reqs: list[Any], *args: Any) -> Any:
    if any(r.seq.params.seed == POISON_SEED for r in reqs):
        raise RuntimeError("injected sampler fault")
    return _verify_step(logits, first, reqs, *args)


if __name__ == "__main__":  # the drafter is registered on import; the sampler fault only here
    from server.cli import serve_main

    specdec.engine.verify_step = faulty_verify_step  # type: ignore[assignment]
    sys.exit(serve_main())
