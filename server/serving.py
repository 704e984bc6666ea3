"""The generation flow shared by /v1/completions, /v1/chat/completions and llama.cpp's
/completion and /infill: tokenize, fit the context, submit n engine requests, then stream chunks
or collect one response."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from experiments.manager import ExperimentManager
from server import llama_api
from server.async_engine import AsyncEngine, RequestFailedError, RequestStream
from server.experiment_runs import ARM_HEADER, KEY_HEADER, track
from server.prompts import Prompt, PromptBuilder
from server.protocol import APIError, GenerationRequest
from server.responses import DONE, Choice, Formatter, sse, with_experiment
from server.tokenizing import PromptLanes

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-", "infill": "infill-",
              "llama_completion": "cmpl-"}
LLAMA_KINDS = ("infill", "llama_completion")


class Serving:
    """Holds what every generation request needs: the engine, the prompt builder and the
    served model name."""

    def __init__(self, engine: AsyncEngine, model_name: str, max_model_len: int,
                 infill_speculative: dict[str, Any] | None = None,
                 draft_models: dict[str, str] | None = None,
                 eagle_heads: dict[str, str] | None = None,
                 experiments: ExperimentManager | None = None) -> None:
        self.engine = engine
        self.experiments = experiments
        self.infill_speculative = infill_speculative
        # The draft models a request may name (name -> what the engine loads): the operator's
        # choice, never a path from a client.
        default = getattr(getattr(engine.engine, "default_spec", None), "draft_model", None)
        self.draft_models = dict(draft_models or {})
        if default:
            self.draft_models.setdefault(str(default), str(default))
        self.default_draft_model = bool(default)
        self.eagle_heads = dict(eagle_heads or {})
        self.model_name = model_name
        self.builder = PromptBuilder(engine.engine.tokenizer, max_model_len,
                                     tuple(getattr(engine.engine, "eos_token_ids", ())))
        # Off the event loop, huge prompts in a lane of their own (server/tokenizing.py).
        self.lanes = PromptLanes(self.builder)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'.", param="model", code="model_not_found")

    async def handle(self, req: GenerationRequest, request: Request) -> Response:
        self.check_model(req.model)
        arrival = time.monotonic()
        prompt = await self.lanes.build(req)
        params = self.builder.fit(req, prompt)
        rid = _ID_PREFIX[req.kind] + uuid.uuid4().hex
        # A request that chose its speculation is outside every experiment.
        arm = None
        if params.speculative is None and self.experiments is not None:
            arm = self.experiments.assign(rid, req.user, request.headers.get(KEY_HEADER))
            if arm is not None:
                params = dataclasses.replace(params, speculative=dict(arm.speculative))
        if req.kind == "infill" and params.speculative is None and self.infill_speculative:
            params = dataclasses.replace(params, speculative=dict(self.infill_speculative))
        if params.speculative is not None:
            params = dataclasses.replace(params, speculative=self.allowed(params.speculative))
        streams = await self._submit(rid, prompt.ids, params, req.n)
        fmt = Formatter(req.kind, self.model_name, self.builder, rid)
        n_prompt = len(prompt.ids)
        headers: dict[str, str] = {}
        if arm is not None and self.experiments is not None:
            streams = track(self.experiments, arm, rid, n_prompt, arrival, streams,
                            self.engine.metrics)
            fmt.tags = arm.tags
            headers[ARM_HEADER] = arm.header
        if req.stream:
            if req.kind == "chat":
                body = _stream_chat(fmt, req, streams, n_prompt)
            elif req.kind in LLAMA_KINDS:
                body = self._stream_llama(req, streams, prompt, params, fmt.tags)
            else:
                body = _stream_completion(fmt, req, streams, n_prompt, prompt.text)
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        choices = await _collect(streams, request)
        if choices is None:  # the client left; nobody reads this
            return Response(status_code=499)
        if req.kind == "chat":
            return JSONResponse(fmt.chat(choices, n_prompt, req.chat_logprobs), headers=headers)
        if req.kind in LLAMA_KINDS:
            body = self._llama_final(choices[0], req, prompt, params, False, fmt.tags)
            return JSONResponse(body, headers=headers)
        prefix = prompt.text if req.echo else ""
        return JSONResponse(fmt.completion(choices, n_prompt, prefix,
                                           req.params.logprobs is not None), headers=headers)

    def allowed(self, spec: dict[str, Any]) -> dict[str, Any]:
        """A request's speculation with its draft model mapped to what the server loads; a name
        the operator did not allow is a 400 that says nothing of the filesystem."""
        spec = dict(spec)
        for key, allowed, flag in (("draft_model", self.draft_models, "--draft-models"),
                                   ("eagle_head", self.eagle_heads, "--eagle-heads")):
            name = spec.get(key)
            if name is None:
                continue
            if name not in allowed:
                names = ", ".join(sorted(allowed)) or "none"
                raise APIError(400, f"'speculative.{key}' must be one of this server's names: "
                               f"{names} (serve {flag} NAME=... adds more)",
                               param=f"speculative.{key}", code="invalid_value")
            spec[key] = allowed[name]
        return spec

    def _llama_final(self, choice: Choice, req: GenerationRequest, prompt: Prompt,
                     params: Any, stream: bool,
                     tags: dict[str, str] | None = None) -> dict[str, Any]:
        body = llama_api.final_body(choice, len(prompt.ids), prompt.text, params, req.llama,
                                    self.model_name, self.builder.max_model_len, stream,
                                    prompt.truncated, self.builder)
        if tags and "speculative" in body:
            body["speculative"] = with_experiment(body["speculative"], tags)
        return body

    async def _stream_llama(self, req: GenerationRequest, streams: list[RequestStream],
                            prompt: Prompt, params: Any,
                            tags: dict[str, str] | None = None) -> AsyncIterator[bytes]:
        """llama.cpp streams an object per step with `content` and `stop: false`, then the
        whole response with empty `content` and `stop: true`; no [DONE]."""
        choice = Choice(0)
        try:
            async for _, out in _merge(streams):
                choice.add(out)
                if out.delta_text or out.delta_token_ids:
                    yield sse(llama_api.partial_body(out, len(prompt.ids), req.llama,
                                                     self.builder))
            yield sse(self._llama_final(choice, req, prompt, params, True, tags))
        except RequestFailedError as exc:
            yield _error_event(exc)

    async def _submit(self, rid: str, ids: list[int], params: Any, n: int) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i in range(n):
                p = params
                if n > 1:
                    seed = None if params.seed is None else params.seed + i
                    p = dataclasses.replace(params, seed=seed)
                streams.append(await self.engine.submit(rid if n == 1 else f"{rid}-{i}", ids, p))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave the outputs of a request's n choices as they arrive."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()  # no-op once finished; frees the engine's blocks otherwise
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(streams: list[RequestStream], request: Request) -> list[Choice] | None:
    """Gather every choice to its end, or return None (aborting) if the client disconnects."""
    choices = [Choice(i) for i in range(len(streams))]

    async def run() -> None:
        async for i, out in _merge(streams):
            choices[i].add(out)

    work = asyncio.create_task(run())
    watch = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
    if work in done:
        work.result()  # re-raise an engine failure
        return choices
    for s in streams:
        s.abort()
    return None


def _error_event(exc: Exception) -> bytes:
    return sse(APIError(500, str(exc), code="engine_error").body())


async def _stream_completion(fmt: Formatter, req: GenerationRequest,
                             streams: list[RequestStream], n_prompt: int,
                             prompt_text: str) -> AsyncIterator[bytes]:
    choices = [Choice(i) for i in range(len(streams))]
    want_lp = req.params.logprobs is not None
    inc = req.include_usage
    offsets = [len(prompt_text) if req.echo else 0] * len(streams)
    try:
        if req.echo:
            for c in choices:
                yield fmt.completion_chunk(c.index, prompt_text, [] if want_lp else None, 0,
                                           None, inc)
        async for i, out in _merge(streams):
            choices[i].add(out)
            if out.delta_text or out.delta_token_ids or out.finished:
                entries = list(out.logprobs or []) if want_lp else None
                finish = out.finish_reason if out.finished else None
                yield fmt.completion_chunk(i, out.delta_text, entries, offsets[i], finish, inc)
                offsets[i] += len(out.delta_text)
        if inc:
            yield fmt.usage_chunk(n_prompt, choices)
    except RequestFailedError as exc:
        yield _error_event(exc)
    yield DONE


async def _stream_chat(fmt: Formatter, req: GenerationRequest, streams: list[RequestStream],
                       n_prompt: int) -> AsyncIterator[bytes]:
    choices = [Choice(i) for i in range(len(streams))]
    want_lp = req.chat_logprobs
    inc = req.include_usage
    try:
        for c in choices:
            yield fmt.chat_chunk(c.index, {"role": "assistant", "content": ""}, None, None, inc)
        async for i, out in _merge(streams):
            choices[i].add(out)
            if out.delta_text or (want_lp and out.logprobs):
                entries = list(out.logprobs or []) if want_lp else None
                yield fmt.chat_chunk(i, {"content": out.delta_text}, entries, None, inc)
            if out.finished:
                yield fmt.chat_chunk(i, {}, None, out.finish_reason, inc)
        if inc:
            yield fmt.usage_chunk(n_prompt, choices)
    except RequestFailedError as exc:
        yield _error_event(exc)
    yield DONE
