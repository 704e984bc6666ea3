"""The offline Python API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from specdec.engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams


class LLM:
    """A model with an engine around it.

    `speculative` is the engine-wide default, the same dict a request's
    `SamplingParams(speculative=...)` takes; None picks the model's paired draft model, or
    n-gram lookup for a model without one; `{"method": "none"}` turns speculation off."""

    def __init__(self, model: str = "qwen2.5-coder-1.5b", dtype: str = "float32",
                 device: str = "cpu", speculative: dict[str, Any] | None = None, **kw: Any):
        self.engine = LLMEngine.from_args(model=model, dtype=dtype, device=device,
                                          speculative=speculative, **kw)
        if self.engine.plans_speculation:
            self.engine.load_default_drafter()  # loaded now, and its pass measured with ours
            self.engine.calibrate_costs()
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _add(self, prompts, params) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        for prompt, p in zip(prompts, plist):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p or SamplingParams())
            ids.append(rid)
        return ids

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        ids = self._add(prompts, params or SamplingParams())
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
               params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Yield each request's deltas as the engine produces them."""
        ids = set(self._add(prompts, params or SamplingParams()))
        while ids:
            for out in self.engine.step():
                if out.request_id in ids:
                    yield out
                    if out.finished:
                        ids.discard(out.request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
