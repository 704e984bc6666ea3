"""Response bodies and stream chunks in OpenAI's and llama.cpp's shapes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from server.prompts import PromptBuilder

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Choice:
    """What one choice has produced so far, accumulated across RequestOutputs."""

    index: int
    last: Any = None
    logprobs: list[Any] = field(default_factory=list)  # (token_id, logprob, {top_id: logprob})

    def add(self, out: Any) -> None:
        self.last = out
        if out.logprobs:
            self.logprobs.extend(out.logprobs)

    @property
    def text(self) -> str:
        return self.last.text if self.last is not None else ""

    @property
    def n_tokens(self) -> int:
        return len(self.last.token_ids) if self.last is not None else 0

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last is not None else None


def _positions(specs: list[Any], attr: str) -> list[int]:
    out: list[int] = []
    for s in specs:
        counts = list(getattr(s, attr, None) or [])
        out.extend([0] * (len(counts) - len(out)))
        for i, c in enumerate(counts):
            out[i] += c
    return out


def speculative_usage(specs: list[Any]) -> dict[str, Any] | None:
    """The request's speculation counters, summed over its choices; None without speculation."""
    specs = [s for s in specs if s is not None and getattr(s, "method", "none") != "none"]
    if not specs:
        return None
    steps = sum(s.steps for s in specs)
    # tau counts the bonus token: one more emitted token than accepted per verification step.
    emitted = sum(getattr(s, "emitted_tokens", s.accepted_tokens + s.steps) for s in specs)
    return {"method": specs[0].method, "draft_tokens": sum(s.draft_tokens for s in specs),
            "accepted_tokens": sum(s.accepted_tokens for s in specs), "steps": steps,
            "tau": emitted / steps if steps else 0.0,
            "accepted_per_position": _positions(specs, "accepted_per_position"),
            "drafted_per_position": _positions(specs, "drafted_per_position")}


def with_experiment(spec: dict[str, Any] | None,
                    tags: dict[str, str] | None) -> dict[str, Any] | None:
    """`usage.speculative` of a request an experiment assigned: its experiment and arm added
    (a control arm without speculation reports method "none")."""
    if not tags:
        return spec
    return {**(spec or {"method": "none"}), **tags}


def usage(n_prompt: int, choices: list[Choice],
          tags: dict[str, str] | None = None) -> dict[str, Any]:
    completion = sum(c.n_tokens for c in choices)
    cached = max((getattr(c.last, "num_cached_tokens", 0) or 0 for c in choices if c.last),
                 default=0)
    return {"prompt_tokens": n_prompt, "completion_tokens": completion,
            "total_tokens": n_prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "speculative": with_experiment(
                speculative_usage([c.last.spec for c in choices if c.last]), tags)}


def logprob_entry(e: Any) -> tuple[int, float, dict[int, float]]:
    """One token's logprobs, as the engine's TokenLogprob or a (token_id, logprob, top) tuple."""
    if isinstance(e, tuple):
        return int(e[0]), float(e[1]), dict(e[2] or {})
    return int(e.token_id), float(e.logprob), dict(e.top or {})


def completion_logprobs(pb: PromptBuilder, entries: list[Any], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, text offsets from `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for token_id, lp, top in map(logprob_entry, entries):
        text = pb.token_text(token_id)
        tokens.append(text)
        lps.append(lp)
        tops.append({pb.token_text(t): v for t, v in top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(pb: PromptBuilder, entries: list[Any]) -> dict[str, Any]:
    def item(token_id: int, lp: float) -> dict[str, Any]:
        text = pb.token_text(token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [
        {**item(t, lp), "top_logprobs": [item(k, v) for k, v in top.items()]}
        for t, lp, top in map(logprob_entry, entries)]}


class Formatter:
    """Builds the bodies for one request, whose id, model and creation time it holds."""

    def __init__(self, kind: str, model: str, pb: PromptBuilder, request_id: str) -> None:
        self.kind = kind
        self.model = model
        self.pb = pb
        self.id = request_id
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.tags: dict[str, str] | None = None  # an experiment's {experiment, arm}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole responses ----

    def completion(self, choices: list[Choice], n_prompt: int, prefix: str,
                   want_logprobs: bool) -> dict[str, Any]:
        body = self._head("text_completion")
        body["choices"] = [{
            "index": c.index, "text": prefix + c.text, "finish_reason": c.finish_reason,
            "logprobs": completion_logprobs(self.pb, c.logprobs, len(prefix))
            if want_logprobs else None} for c in choices]
        body["usage"] = usage(n_prompt, choices, self.tags)
        return body

    def chat(self, choices: list[Choice], n_prompt: int, want_logprobs: bool) -> dict[str, Any]:
        body = self._head("chat.completion")
        body["choices"] = [{
            "index": c.index, "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": chat_logprobs(self.pb, c.logprobs) if want_logprobs else None}
            for c in choices]
        body["usage"] = usage(n_prompt, choices, self.tags)
        return body

    # ---- stream chunks ----

    def completion_chunk(self, index: int, text: str, entries: list[Any] | None,
                         offset: int, finish: str | None, with_usage: bool) -> bytes:
        chunk = self._head("text_completion")
        chunk["choices"] = [{
            "index": index, "text": text, "finish_reason": finish,
            "logprobs": completion_logprobs(self.pb, entries, offset)
            if entries is not None else None}]
        if with_usage:
            chunk["usage"] = None
        return sse(chunk)

    def chat_chunk(self, index: int, delta: dict[str, Any], entries: list[Any] | None,
                   finish: str | None, with_usage: bool) -> bytes:
        chunk = self._head("chat.completion.chunk")
        chunk["choices"] = [{
            "index": index, "delta": delta, "finish_reason": finish,
            "logprobs": chat_logprobs(self.pb, entries) if entries is not None else None}]
        if with_usage:
            chunk["usage"] = None
        return sse(chunk)

    def usage_chunk(self, n_prompt: int, choices: list[Choice]) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = self._head(obj)
        chunk["choices"] = []
        chunk["usage"] = usage(n_prompt, choices, self.tags)
        return sse(chunk)
