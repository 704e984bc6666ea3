"""A hand-written OpenAPI 3 description of the server's endpoints and request bodies."""

from __future__ import annotations

from typing import Any

from server.experiments_api import EXPERIMENT_SCHEMA, openapi_paths


def _num(desc: str, lo: float | None = None, hi: float | None = None,
         integer: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer" if integer else "number", "description": desc}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


_STOP = {"description": "Up to 16 strings that end generation (not included in the output)",
         "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                         "maxItems": 16}]}

SPECULATIVE = {
    "type": "object", "nullable": True,
    "description": "Per-request speculation; omitted or null uses the server's default.",
    "properties": {
        "method": {"type": "string", "description": "'ngram', 'draft_model' or 'none'"},
        "num_speculative_tokens": _num("Draft tokens per step", 0, 64, integer=True),
    },
    "additionalProperties": True,
}

SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "description": "Must match the served model id if given"},
    "temperature": _num("0 is greedy", 0, 2),
    "top_p": _num("Nucleus sampling mass", 0, 1),
    "top_k": _num("-1 or 0 disables", -1, integer=True),
    "min_p": _num("Minimum probability relative to the top token", 0, 1),
    "presence_penalty": _num("OpenAI presence penalty", -2, 2),
    "frequency_penalty": _num("OpenAI frequency penalty", -2, 2),
    "repetition_penalty": _num("Multiplicative repetition penalty (1 is off)", 0, 10),
    "stop": _STOP,
    "seed": _num("Sampling seed; with n > 1 choice i uses seed + i", integer=True),
    "n": _num("Number of choices", 1, 16, integer=True),
    "stream": {"type": "boolean", "description": "Server-sent events ending in data: [DONE]"},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "speculative": SPECULATIVE,
}

COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"description": "Text, token ids, or a list of one of either",
               "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                         {"type": "array", "maxItems": 1, "items": {"type": "string"}}]},
    "suffix": {"type": "string", "description": "Fill-in-the-middle: text after the cursor; "
               "needs a model with FIM tokens"},
    "max_tokens": _num("Default 16", 1, integer=True),
    "logprobs": _num("Top-n log-probabilities per token", 0, 20, integer=True),
    "echo": {"type": "boolean"},
    **SAMPLING}}

CHAT = {"type": "object", "required": ["messages"], "properties": {
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"], "properties": {
            "role": {"type": "string",
                     "enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "properties": {"type": {"enum": ["text"]},
                                                 "text": {"type": "string"}}}}]}}}},
    "max_tokens": _num("Default: the rest of the context", 1, integer=True),
    "max_completion_tokens": _num("Alias of max_tokens", 1, integer=True),
    "logprobs": {"type": "boolean"},
    "top_logprobs": _num("Needs logprobs: true", 0, 20, integer=True),
    **SAMPLING}}

LLAMA_COMMON = {
    "n_predict": _num("-1: until the context is full; 0: one token", -1, integer=True),
    "n_indent": _num("Stop at a later line indented less than this", 0, integer=True),
    "t_max_predict_ms": _num("Once spent (from the first token), stop after the next token "
                             "that follows a newline", None),
    "t_max_prompt_ms": _num("Accepted, not acted on (as llama.cpp)", None),
    "samplers": {"description": "llama.cpp sampler names or letters; applied: penalties, "
                 "temperature, top_k, top_p, min_p, infill",
                 "oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]},
    "cache_prompt": {"type": "boolean", "description": "false: compute the whole prompt"},
    "n_probs": _num("Top-n log-probabilities (completion_probabilities)", 0, 20, integer=True),
    "response_fields": {"type": "array", "items": {"type": "string"},
                        "description": "Paths such as 'timings/prompt_n': the response holds "
                        "only these, keyed by path"},
    "return_tokens": {"type": "boolean"},
    "repeat_penalty": _num("Alias of repetition_penalty", 0, 10),
    **{k: v for k, v in SAMPLING.items() if k not in ("n", "stream_options")}}

INFILL = {"type": "object", "description": "llama.cpp's /infill request", "properties": {
    "input_prefix": {"type": "string"}, "input_suffix": {"type": "string"},
    "input_extra": {"type": "array", "items": {"type": "object", "required": ["text"],
                                               "properties": {"filename": {"type": "string"},
                                                              "text": {"type": "string"}}}},
    "prompt": {"type": "string", "description": "The cursor line's start, after the prefix"},
    **LLAMA_COMMON}}

LLAMA_COMPLETION = {"type": "object", "description": "llama.cpp's /completion request",
                    "required": ["prompt"], "properties": {
                        "prompt": {"oneOf": [{"type": "string"}, {
                            "type": "array", "items": {"type": "integer"}}]},
                        **LLAMA_COMMON}}

ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"},
    "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True},
}}}}

USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "speculative": {"type": "object", "nullable": True, "properties": {
        "method": {"type": "string"}, "draft_tokens": {"type": "integer"},
        "accepted_tokens": {"type": "integer"}, "steps": {"type": "integer"},
        "tau": {"type": "number"},
        "accepted_per_position": {"type": "array", "items": {"type": "integer"}},
        "drafted_per_position": {"type": "array", "items": {"type": "integer"}}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    text = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            408: "Body not received within --body-timeout",
            413: "Prompt longer than the context", 415: "Content-Type is not application/json",
            429: "Queue full, or too many requests in flight from this client (see Retry-After)",
            500: "The engine failed on this request (other requests go on)",
            503: "Shutting down"}
    return {str(c): {"description": text[c], **ref} for c in codes}


def _post(summary: str, schema: str, ok: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": ok, "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 408, 413, 415, 429, 500, 503)}}}


def _get(summary: str, media: str = "application/json", auth: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {media: {
        "schema": {"type": "string" if media.startswith("text") else "object"}}}}}
    if auth:
        responses.update(_errors(401))
    return {"get": {"summary": summary, "responses": responses}}


def openapi_schema(model_name: str) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "specdec", "version": "0.1.0",
                 "description": f"OpenAI-compatible server for {model_name} with speculative "
                 "decoding. Authenticate with 'Authorization: Bearer <key>' when the server "
                 "was started with --api-key."},
        "paths": {
            "/v1/completions": _post("Text and fill-in-the-middle completion", "Completion",
                                     "text_completion object or chunks"),
            "/v1/chat/completions": _post("Chat completion", "ChatCompletion",
                                          "chat.completion object or chunks"),
            "/infill": _post("llama.cpp's code infill", "Infill",
                             "llama.cpp's {content, stop, timings, ...}"),
            "/completion": _post("llama.cpp's completion", "LlamaCompletion",
                                 "llama.cpp's {content, stop, timings, ...}"),
            "/v1/models": _get("The served model", auth=True),
            "/health": _get("200 while serving, 503 while draining"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("This document"),
            **openapi_paths(),
        },
        "components": {
            "schemas": {"Completion": COMPLETION, "ChatCompletion": CHAT, "Infill": INFILL,
                        "LlamaCompletion": LLAMA_COMPLETION,
                        "Error": ERROR, "Usage": USAGE, "Experiment": EXPERIMENT_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
