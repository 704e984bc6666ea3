"""Tokenizing off the event loop, in two lanes: a huge prompt never holds up a small one.

One tokenizer thread took requests in arrival order, so a tiny request behind a 10 MB prompt
waited the seconds that prompt took. Prompts of `BIG_PROMPT_CHARS` or more now go to a thread
of their own, with its own tokenizer copy (a Rust-backed tokenizer must not be used by two
threads at once, and it lets go of the GIL while it works, so the lanes run side by side).
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from server.prompts import Prompt, PromptBuilder
from server.protocol import GenerationRequest

# About 70 ms of tokenizing on one core of the CI machine.
BIG_PROMPT_CHARS = 1 << 16


def prompt_chars(req: GenerationRequest) -> int:
    """How much text the request's prompt has to tokenize (token-id prompts: none)."""
    texts = [req.prompt if isinstance(req.prompt, str) else "", req.suffix or "",
             req.input_prefix, req.input_suffix]
    texts += [m.get("content") for m in req.messages]
    texts += [c.get("text") for c in req.input_extra]
    return sum(len(t) for t in texts if isinstance(t, str))


class PromptLanes:
    """`build` a request's prompt on the small or the big lane's thread. `builder` serves the
    small lane; the big lane gets a copy of it."""

    def __init__(self, builder: PromptBuilder, big_chars: int = BIG_PROMPT_CHARS) -> None:
        self.big_chars = big_chars
        self.lanes = ((builder, ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize")),
                      (copy.deepcopy(builder),
                       ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize-big")))

    async def build(self, req: GenerationRequest) -> Prompt:
        builder, pool = self.lanes[prompt_chars(req) >= self.big_chars]
        return await asyncio.get_running_loop().run_in_executor(pool, builder.build, req)
