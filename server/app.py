"""The Starlette application: routes, API-key auth, and the mapping of every failure to an
OpenAI error object."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from experiments.manager import ExperimentManager
from server import llama_api, protocol
from server.async_engine import AsyncEngine, QueueFullError, RequestFailedError, ShuttingDownError
from server.cors import CORS
from server.experiments_api import ExperimentsAPI
from server.limits import BODY_TIMEOUT_S, ClientLimit, read_within
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openapi import Served, openapi_schema
from server.protocol import APIError
from server.serving import Serving

log = logging.getLogger("specdec.server")
Handler = Callable[[Request], Awaitable[Response]]


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


MAX_BODY_BYTES = 8 << 20


def to_api_error(exc: Exception) -> APIError:
    """Map what submitting or running a request can raise to the client's error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClientDisconnect):  # the client left mid-body: nobody reads this
        log.debug("client disconnected while sending its request")
        return APIError(499, "client closed the request", code="client_closed_request")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ShuttingDownError):
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, ValueError):  # the engine rejected the request as given
        msg = str(exc)
        if "context" in msg.lower() or "too long" in msg.lower():
            return APIError(413, msg, param="prompt", code="context_length_exceeded")
        return APIError(400, msg)
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="engine_error")
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


async def read_body(request: Request, limit: int) -> bytes:
    too_big = APIError(413, f"request body over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class HostCheck:
    """Answers 400 to a request whose Host header names a host not in `allowed` ("*": any)."""

    def __init__(self, app: Any, allowed: list[str]) -> None:
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit("]", 1)[0] + "]" if host.startswith("[") else host.split(":")[0]
            if name not in self.allowed:
                err = APIError(400, f"Host {host!r} is not allowed here (serve "
                               "--allowed-hosts)", code="host_not_allowed")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Any, api_key: str | None = None, *, max_waiting: int | None = None,
              model_name: str | None = None, metrics: ServerMetrics | None = None,
              shutdown_grace: float = 0.0,
              infill_speculative: dict[str, Any] | None = None,
              draft_models: dict[str, str] | None = None,
              eagle_heads: dict[str, str] | None = None,
              allowed_hosts: list[str] | None = None,
              max_body_bytes: int = MAX_BODY_BYTES,
              allowed_origins: list[str] | None = None,
              body_timeout: float | None = BODY_TIMEOUT_S,
              max_concurrent_per_client: int | None = None,
              experiments: ExperimentManager | None = None) -> Starlette:
    """Build the app around an `LLMEngine` (wrapped here) or an `AsyncEngine`.

    The app owns the AsyncEngine's lifetime: lifespan shutdown aborts what is still running
    after `shutdown_grace` seconds (the CLI drains before that, on SIGTERM).
    `infill_speculative`: the speculation of /infill requests that choose none (None: the
    engine's default, as for every request). `draft_models`: the draft models requests may
    name (name -> the model the engine loads), besides the engine's default one; `eagle_heads`
    likewise the EAGLE heads.
    `allowed_hosts`: the Host header values (without port) a request may carry; None: any. A
    server on a loopback address takes only local names, so that a web page that rebinds its own
    name to 127.0.0.1 cannot reach it (the CLI's default). A body over `max_body_bytes` is a 413,
    answered as soon as its declared or received length passes the limit, one that has not
    arrived within `body_timeout` seconds a 408. `allowed_origins`: the origins whose pages may
    call the server (CORS, server/cors.py); none by default. `max_concurrent_per_client`: the
    POST requests one API key (or, without one, one address) may have in flight (None: any).
    `experiments`: the A/B experiments that assign requests choosing no speculation, and their
    admin API and dashboard (server/experiments_api.py); None: neither."""
    if isinstance(engine, AsyncEngine):
        aengine = engine
    else:
        aengine = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics)
    metrics = aengine.metrics
    name = model_name or str(getattr(aengine.engine, "model_name", "specdec"))
    max_len = int(aengine.engine.max_model_len)
    serving = Serving(aengine, name, max_len, infill_speculative, draft_models, eagle_heads,
                      experiments)
    started = int(time.time())

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  api_key.encode()):
            raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def endpoint(label: str, fn: Handler, auth: bool = True) -> Handler:
        async def handler(request: Request) -> Response:
            try:
                if auth:
                    check_auth(request)
                resp = await fn(request)
            except Exception as exc:
                resp = error_response(to_api_error(exc))
            metrics.requests.labels(label, str(resp.status_code)).inc()
            return resp

        return handler

    def generation(parse: Callable[[dict[str, Any]], protocol.GenerationRequest]) -> Handler:
        async def run(request: Request) -> Response:
            # JSON only: a web page can send a form or text/plain across sites without asking
            # (no CORS preflight), never application/json.
            media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise APIError(415, "Content-Type must be application/json",
                               code="unsupported_media_type")
            body = protocol.parse_json(await read_within(read_body(request, max_body_bytes),
                                                         body_timeout))
            req = parse(body)
            req.user = protocol.read_str(body, "user")
            return await serving.handle(req, request)

        return run

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": started, "owned_by": "specdec",
            "max_model_len": max_len}]})

    async def health(_: Request) -> Response:
        if aengine.draining or not aengine.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "running": aengine.engine.num_running,
                             "waiting": aengine.engine.num_waiting})

    async def metrics_text(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    document = openapi_schema(Served(
        name, max_model_len=max_len, vocab_size=len(serving.builder.tok), auth=api_key is not None,
        experiments=experiments is not None, draft_models=tuple(serving.draft_models),
        default_draft_model=serving.default_draft_model,
        eagle_heads=tuple(serving.eagle_heads)))

    async def openapi(_: Request) -> Response:
        return JSONResponse(document)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        err = APIError(status, f"{request.method} {request.url.path}: "
                       f"{getattr(exc, 'detail', 'error')}",
                       code="not_found" if status == 404 else None,
                       headers=dict(getattr(exc, "headers", None) or {}))  # a 405's Allow
        metrics.requests.labels("unknown", str(status)).inc()
        return error_response(err)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await aengine.shutdown(shutdown_grace)
        if experiments is not None:
            await asyncio.to_thread(experiments.close)  # after the last records are queued

    routes = [
        Route("/v1/completions", endpoint("completions", generation(protocol.parse_completion)),
              methods=["POST"]),
        Route("/v1/chat/completions", endpoint("chat", generation(protocol.parse_chat)),
              methods=["POST"]),
        Route("/infill", endpoint("infill", generation(llama_api.parse_infill)),
              methods=["POST"]),
        Route("/completion", endpoint("completion", generation(llama_api.parse_completion)),
              methods=["POST"]),
        Route("/v1/models", endpoint("models", models), methods=["GET"]),
        Route("/health", endpoint("health", health, auth=False), methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if experiments is not None:
        admin = ExperimentsAPI(experiments, api_key, lambda r: read_within(
            read_body(r, max_body_bytes), body_timeout), serving.allowed)
        for exp in experiments.experiments():
            if exp.state != "stopped":  # a request must never fail on its arm's names
                admin.check_arms(exp, f"experiment {exp.name!r}: ")
        routes += admin.routes(endpoint)
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found},
                    lifespan=lifespan)
    # The last added runs first: Host, then CORS, then the per-client count.
    if max_concurrent_per_client is not None:
        app.add_middleware(ClientLimit, limit=max_concurrent_per_client,
                           by_key=api_key is not None)
    app.add_middleware(CORS, origins=allowed_origins or [])
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    app.state.engine = aengine
    app.state.serving = serving
    return app
