"""A hand-written OpenAPI 3 description of the server's endpoints: paths, responses, errors.

The document describes the server as it was started: the served model's name and context, the
speculation it can run (the draft models and EAGLE heads it was given), whether it needs an API
key, and whether the experiments' admin API is on. The request bodies are in
server/request_schemas.py.
"""

from __future__ import annotations

from typing import Any

from server.experiments_api import experiment_schema, openapi_paths
from server.request_schemas import (
    Served,
    chat_schema,
    completion_schema,
    infill_schema,
    llama_completion_schema,
    speculative_schema,
)

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": "string", "nullable": True},
        "code": {"type": "string", "nullable": True}}}}}

USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "speculative": {"type": "object", "nullable": True, "properties": {
        "method": {"type": "string"}, "draft_tokens": {"type": "integer"},
        "accepted_tokens": {"type": "integer"}, "steps": {"type": "integer"},
        "tau": {"type": "number"},
        "accepted_per_position": {"type": "array", "items": {"type": "integer"}},
        "drafted_per_position": {"type": "array", "items": {"type": "integer"}}}}}}


def _result(obj: str) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string",
                                                                 "enum": [obj]},
                           "model": {"type": "string"}, "choices": {"type": "array"},
                           "usage": {"$ref": "#/components/schemas/Usage"}}}


LLAMA_RESULT = {"type": "object", "description": "llama.cpp's {content, stop, timings, ...}; "
                "with response_fields, only those paths"}

_ERRORS = {400: "Invalid request (the error's param names the field)",
           401: "Missing or wrong API key", 403: "Not allowed from this client",
           404: "Unknown model or resource", 408: "Body not received within --body-timeout",
           409: "Conflicts with the resource's state",
           413: "Body over the size limit, or prompt longer than the context",
           415: "Content-Type is not application/json",
           429: "Queue full, or too many requests in flight from this client (see Retry-After)",
           500: "The engine failed on this request (other requests go on)",
           503: "Shutting down (see Retry-After)"}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying",
                                "schema": {"type": "integer"}}}


def errors(*codes: int, text: dict[int, str] | None = None) -> dict[str, Any]:
    """Responses for `codes`, each an OpenAI error object."""
    out: dict[str, Any] = {}
    for c in codes:
        out[str(c)] = {"description": (text or {}).get(c, _ERRORS[c]), "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if c in (429, 503):
            out[str(c)]["headers"] = _RETRY_AFTER
    return out


SSE_EVENT = {"type": "object", "required": ["data"], "description": "One event",
             "properties": {"data": {"type": "string", "description": "A JSON chunk (with "
                                     "'error' if the engine failed), or [DONE]"}}}
_CLIENT_CLOSED = {"499": {"description": "The client closed the connection before the response "
                          "(nobody reads it; the body, if any, is an error object)"}}


def _post(served: Served, summary: str, schema: str, ok: dict[str, Any]) -> dict[str, Any]:
    codes = (400, 404, 408, 413, 415, 429, 500, 503) + ((401,) if served.auth else ())
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": "The result, or with stream: true server-sent "
                              "events", "content": {
                                  "application/json": {"schema": ok},
                                  "text/event-stream": {"schema": SSE_EVENT}}},
                      **errors(*sorted(codes)), **_CLIENT_CLOSED},
        **_security(served)}}


def _security(served: Served) -> dict[str, Any]:
    return {"security": [{"bearer": []}]} if served.auth else {}


def _get(summary: str, schema: dict[str, Any], media: str = "application/json",
         auth: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK",
                                         "content": {media: {"schema": schema}}}}
    if auth:
        responses.update(errors(401))
    responses.update(extra or {})
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if auth:
        op["security"] = [{"bearer": []}]
    return {"get": op}


MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "max_model_len"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"}, "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"}}}}}}
HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"type": "string", "enum": ["ok", "unavailable"]},
    "running": {"type": "integer"}, "waiting": {"type": "integer"}}}
METHOD_NOT_ALLOWED = {
    "description": "A method the path does not take (HEAD goes with GET); Allow lists those "
    "it takes", "headers": {"Allow": {"required": True, "schema": {"type": "string"}}},
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def openapi_schema(served: Served | str) -> dict[str, Any]:
    if isinstance(served, str):
        served = Served(served)
    paths: dict[str, Any] = {
        "/v1/completions": _post(served, "Text and fill-in-the-middle completion",
                                 "Completion", _result("text_completion")),
        "/v1/chat/completions": _post(served, "Chat completion", "ChatCompletion",
                                      _result("chat.completion")),
        "/infill": _post(served, "llama.cpp's code infill", "Infill", LLAMA_RESULT),
        "/completion": _post(served, "llama.cpp's completion", "LlamaCompletion",
                             LLAMA_RESULT),
        "/v1/models": _get("The served model", MODELS, auth=served.auth),
        "/health": _get("200 while serving, 503 while draining", HEALTH, extra={
            "503": {"description": "Draining or failed to load",
                    "content": {"application/json": {"schema": HEALTH}}}}),
        "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
        "/openapi.json": _get("This document", {"type": "object"}),
    }
    schemas: dict[str, Any] = {
        "Completion": completion_schema(served), "ChatCompletion": chat_schema(served),
        "Infill": infill_schema(served), "LlamaCompletion": llama_completion_schema(served),
        "Error": ERROR, "Usage": USAGE}
    if served.experiments:
        paths.update(openapi_paths(served.auth))
        schemas["Experiment"] = experiment_schema(speculative_schema(served, file_alias=True))
    components: dict[str, Any] = {"schemas": schemas,
                                  "responses": {"MethodNotAllowed": METHOD_NOT_ALLOWED}}
    if served.auth:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "dashboard_key": {"type": "apiKey", "in": "query", "name": "key"}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "specdec", "version": "0.1.0",
                 "description": f"OpenAI-compatible server for {served.model_name} with "
                 "speculative decoding. "
                 + ("Authenticate with 'Authorization: Bearer <key>'. " if served.auth else "")
                 + "A Host header the server does not take is a 400 on every path; a method a "
                 "path does not take is a 405 (components.responses.MethodNotAllowed)."},
        "paths": paths,
        "components": components,
    }
