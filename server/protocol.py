"""Parsing and validation of request bodies into typed requests.

Everything a client can get wrong is caught here and raised as an `APIError` carrying the OpenAI
error object, so that a bad request is answered before it reaches the engine. Unknown fields are
ignored (editors send many vendor extensions); known fields with wrong types or out-of-range
values are rejected, naming the field in `param`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from drafters import check_speculative
from specdec.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
UNSET_MAX_TOKENS = 1 << 30
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _default_type(status: int) -> str:
    return {401: "authentication_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "server_error" if status >= 500
                                            else "invalid_request_error")


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


@dataclass
class GenerationRequest:
    """A validated request, endpoint-neutral. The prompt is not yet tokenized: `kind` says how
    `prompt`, `suffix`, `messages` or the infill fields become token ids."""

    kind: str  # "completion" | "chat" | "infill" | "llama_completion" (llama.cpp's /completion)
    model: str | None
    params: SamplingParams
    max_tokens_given: bool  # False: the server may fill the rest of the context
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    prompt: str | list[int] = ""
    suffix: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    input_extra: list[dict[str, str]] = field(default_factory=list)
    input_prefix: str = ""
    input_suffix: str = ""
    chat_logprobs: bool = False  # chat's boolean `logprobs`
    llama: Any = None  # server.llama_api.LlamaFields for llama.cpp's endpoints
    user: str | None = None  # OpenAI's end-user id: an experiment's assignment unit


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(None, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid(None, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid(None, "request body must be a JSON object")
    try:  # a lone UTF-16 surrogate ("\ud800") is valid JSON and no text a tokenizer takes
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(None, "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) "
                      "outside a pair: not text") from None
    return body


# ---- field readers ------------------------------------------------------------------------

def read_num(body: dict[str, Any], name: str, default: float | None,
             lo: float | None = None, hi: float | None = None, *, integer: bool = False,
             alias: str | None = None) -> Any:
    key = name if name in body or alias is None else alias
    v = body.get(key)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        if integer and isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise invalid(key, f"'{key}' must be {kind}, got {json.dumps(v)[:40]}")
    if math.isnan(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise invalid(key, f"'{key}' must be in {rng}, got {v}")
    return v


def read_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"'{name}' must be a boolean")
    return v


def read_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(name, f"'{name}' must be a string")
    return v


def _stop(body: dict[str, Any], name: str = "stop") -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid(name, f"'{name}' must be a string or a list of strings")
    if len(v) > 16:
        raise invalid(name, f"'{name}' takes at most 16 sequences")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise invalid(name, f"each '{name}' sequence is at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in v if s)


def read_speculative(body: dict[str, Any]) -> dict[str, Any] | None:
    """The per-request speculation, checked in full here (method, keys, types, bounds), so a
    bad option is a 400 before admission and never fails a step shared with other requests.
    Which draft models and heads a request may name is the server's to say (server/serving.py).
    """
    v = body.get("speculative")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("speculative", "'speculative' must be an object such as "
                      '{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        check_speculative(v)
    except ValueError as exc:
        param = str(exc).split(" ", 1)[0]
        raise invalid(param if param.startswith("speculative") else "speculative",
                      str(exc)) from None
    return dict(v)


def _sampling(body: dict[str, Any], max_tokens: int, logprobs: int | None) -> SamplingParams:
    top_k = read_num(body, "top_k", -1, -1, None, integer=True)
    try:
        return SamplingParams(
            temperature=read_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=read_num(body, "top_p", 1.0, 0.0, 1.0) or 1e-6,
            top_k=-1 if top_k == 0 else top_k,
            min_p=read_num(body, "min_p", 0.0, 0.0, 1.0),
            presence_penalty=read_num(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=read_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=read_num(body, "repetition_penalty", 1.0, 0.0, 10.0,
                                        alias="repeat_penalty") or 1.0,
            max_tokens=max_tokens,
            min_tokens=read_num(body, "min_tokens", 0, 0, max_tokens, integer=True),
            stop=_stop(body),
            stop_token_ids=tuple(_stop_token_ids(body)),
            ignore_eos=read_bool(body, "ignore_eos"),
            seed=read_num(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
            logprobs=logprobs,
            speculative=read_speculative(body),
        )
    except ValueError as exc:  # SamplingParams' own checks, phrased by it
        raise invalid(str(exc).split(" ", 1)[0], str(exc)) from None


def _stop_token_ids(body: dict[str, Any]) -> list[int]:
    v = body.get("stop_token_ids")
    ids = [] if v is None else read_token_ids(v, "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS}")
    return ids  # their range is checked against the vocabulary with the prompt


def read_token_ids(v: Any, param: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          and t >= 0 for t in v):
        raise invalid(param, f"'{param}' must be a list of non-negative token ids")
    return list(v)


def _max_tokens(body: dict[str, Any], default: int | None,
                names: tuple[str, ...] = ("max_tokens",)) -> tuple[int, bool]:
    given = [read_num(body, name, None, 1, None, integer=True) for name in names
             if body.get(name) is not None]  # each checked; the first named wins
    if given:
        return given[0], True
    # A placeholder until the prompt length is known: PromptBuilder.fit sets the real value.
    return default or UNSET_MAX_TOKENS, False


def _n_stream(body: dict[str, Any]) -> tuple[int, bool, bool]:
    n = read_num(body, "n", 1, 1, MAX_N, integer=True)
    stream = read_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    include_usage = bool(opts and read_bool(opts, "include_usage"))
    return n, stream, include_usage


# ---- endpoints ----------------------------------------------------------------------------

def parse_completion(body: dict[str, Any]) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise invalid("prompt", "batched prompts are not supported: send one per request")
        prompt = read_token_ids(prompt, "prompt")
        if not prompt:
            raise invalid("prompt", "'prompt' must not be empty")
    elif not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' must be a string or a list of token ids")
    suffix = read_str(body, "suffix")
    if prompt == "" and suffix is None:
        raise invalid("prompt", "'prompt' must not be empty (without a 'suffix')")
    if suffix is not None and not isinstance(prompt, str):
        raise invalid("suffix", "'suffix' needs a string 'prompt'")
    logprobs = read_num(body, "logprobs", None, 0, 20, integer=True)
    echo = read_bool(body, "echo")
    if echo and suffix is not None:
        raise invalid("echo", "'echo' cannot be combined with 'suffix'")
    max_tokens, given = _max_tokens(body, 16)
    n, stream, include_usage = _n_stream(body)
    return GenerationRequest(
        kind="completion", model=read_str(body, "model"),
        params=_sampling(body, max_tokens, logprobs), max_tokens_given=given, n=n, stream=stream,
        include_usage=include_usage, echo=echo, prompt=prompt, suffix=suffix)


def parse_chat(body: dict[str, Any]) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    want_lp = read_bool(body, "logprobs")
    top = read_num(body, "top_logprobs", None, 0, 20, integer=True)
    if top is not None and not want_lp:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    max_tokens, given = _max_tokens(body, None, ("max_completion_tokens", "max_tokens"))
    n, stream, include_usage = _n_stream(body)
    return GenerationRequest(
        kind="chat", model=read_str(body, "model"),
        params=_sampling(body, max_tokens, (top or 0) if want_lp else None),
        max_tokens_given=given, n=n, stream=stream, include_usage=include_usage,
        messages=rendered, chat_logprobs=want_lp)


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(param, f"'{param}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"{param}.role", f"'{param}.role' must be one of {sorted(CHAT_ROLES)}")
    content = m.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text can reach a text model
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise invalid(f"{param}.content", "only text content parts are supported")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise invalid(f"{param}.content", f"'{param}.content' must be a string or a list")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{param}.name", f"'{param}.name' must be a string")
    if name is not None:
        out["name"] = name
    return out
