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
        self.builder = builder
        self._big_builder: PromptBuilder | None = None  # made on the first huge prompt
        self.small = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize")
        self.big = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize-big")

    async def build(self, req: GenerationRequest) -> Prompt:
        loop = asyncio.get_running_loop()
        if prompt_chars(req) < self.big_chars:
            return await loop.run_in_executor(self.small, self.builder.build, req)
        if self._big_builder is None:
            # Copied once, by the first huge prompt, on the small lane's thread (the tokenizer
            # is never touched by two threads at once); tens of MB a server need not hold
            # until then.
            self._big_builder = await loop.run_in_executor(self.small, copy.deepcopy,
                                                           self.builder)
        return await loop.run_in_executor(self.big, self._big_builder.build, req)
