"""The experiments' admin API and the dashboard page.

Reads follow the server's auth: with `--api-key`, every route needs the key; without one, they
are open like the rest of the API. Writes (create, pause, resume, stop) need the key when there
is one; without a key they are taken only from a loopback client. Every write must be sent as
`Content-Type: application/json` (an empty body is fine for pause, resume and stop): a web page
cannot send that across sites without a CORS preflight, so a page the operator visits cannot
drive the API. The dashboard takes the key as `Authorization: Bearer KEY` or as `?key=KEY` (a
browser's address bar sends no header); its script then sends the key as a header.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from experiments.config import Experiment, parse_experiment
from experiments.manager import (
    ExperimentExistsError,
    ExperimentManager,
    StateChangeError,
    UnknownExperimentError,
)
from server import protocol
from server.protocol import APIError

Handler = Callable[[Request], Awaitable[Response]]
Endpoint = Callable[[str, Handler, bool], Handler]
DASHBOARD = Path(__file__).with_name("dashboard.html")
ACTIONS = {"pause": "paused", "resume": "active", "stop": "stopped"}


def field_error(exc: ValueError) -> APIError:
    """A config ValueError ("PATH: message") as a 400 naming PATH."""
    path, sep, msg = str(exc).partition(": ")
    if not sep or " " in path:
        return APIError(400, str(exc), code="invalid_value")
    return APIError(400, f"'{path}' {msg}", param=path, code="invalid_value")


def _is_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ExperimentsAPI:
    """The routes over one ExperimentManager. `allowed` maps an arm's draft model and EAGLE
    head names as the server does for a request (and rejects names it does not serve)."""

    def __init__(self, manager: ExperimentManager, api_key: str | None,
                 read_body: Callable[[Request], Awaitable[bytes]],
                 allowed: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.manager = manager
        self.api_key = api_key
        self.read_body = read_body
        self.allowed = allowed
        self.page = DASHBOARD.read_text(encoding="utf-8")

    def routes(self, endpoint: Endpoint) -> list[Route]:
        return [
            Route("/v1/experiments", endpoint("experiments", self.index, True), methods=["GET"]),
            Route("/v1/experiments", endpoint("experiments", self.create, True),
                  methods=["POST"]),
            Route("/v1/experiments/{name}", endpoint("experiments", self.show, True),
                  methods=["GET"]),
            Route("/v1/experiments/{name}/records", endpoint("experiments", self.records, True),
                  methods=["GET"]),
            Route("/v1/experiments/{name}/{action}", endpoint("experiments", self.act, True),
                  methods=["POST"]),
            Route("/dashboard", endpoint("dashboard", self.dashboard, False), methods=["GET"]),
        ]

    def check_arms(self, exp: Experiment, prefix: str = "") -> None:
        """Every arm's speculation as the server would run it: named draft models and heads
        must be ones this server serves (ValueError naming the field otherwise)."""
        for arm, spec in exp.arms.items():
            try:
                self.allowed(spec)
            except APIError as err:
                key = (err.param or "speculative").removeprefix("speculative")
                raise ValueError(f"{prefix}arms.{arm}{key}: {err.message}") from None

    # ---- writes ----------------------------------------------------------------------------

    async def _write_body(self, request: Request) -> dict[str, Any] | None:
        if self.api_key is None and not _is_loopback(request):
            raise APIError(403, "without --api-key, experiments are changed only from the "
                           "server's own host", code="forbidden", type_="permission_error")
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise APIError(415, "Content-Type must be application/json",
                           code="unsupported_media_type")
        raw = await self.read_body(request)
        return protocol.parse_json(raw) if raw.strip() else None

    async def create(self, request: Request) -> Response:
        body = await self._write_body(request)
        try:
            self.check_arms(parse_experiment(body))
            exp = await asyncio.to_thread(self.manager.create, body)
        except ValueError as exc:
            raise field_error(exc) from None
        except ExperimentExistsError as exc:
            raise APIError(409, str(exc), param="name", code="experiment_exists") from None
        return JSONResponse(self._describe(exp), status_code=201)

    async def act(self, request: Request) -> Response:
        action = request.path_params["action"]
        if action not in ACTIONS:
            raise APIError(404, f"POST {request.url.path}: no such action (choose "
                           f"{', '.join(ACTIONS)})", code="not_found")
        await self._write_body(request)
        try:
            exp = await asyncio.to_thread(self.manager.set_state, request.path_params["name"],
                                          ACTIONS[action])
        except UnknownExperimentError as exc:
            raise APIError(404, str(exc), code="experiment_not_found") from None
        except StateChangeError as exc:
            raise APIError(409, str(exc), param="state", code="invalid_state") from None
        return JSONResponse(self._describe(exp))

    # ---- reads -----------------------------------------------------------------------------

    def _experiment(self, request: Request) -> Experiment:
        try:
            return self.manager.get(request.path_params["name"])
        except UnknownExperimentError as exc:
            raise APIError(404, str(exc), code="experiment_not_found") from None

    def _describe(self, exp: Experiment) -> dict[str, Any]:
        current = self.manager.current()
        return {**exp.to_dict(), "assigning": current is not None and current.name == exp.name}

    async def index(self, _: Request) -> Response:
        current = self.manager.current()
        return JSONResponse({"object": "list", "assigning": current.name if current else None,
                             "data": [self._describe(e) for e in self.manager.experiments()]})

    async def show(self, request: Request) -> Response:
        exp = self._experiment(request)
        alpha = _level(request, "alpha", 0.05, 0.5)
        mde = _level(request, "mde", 0.05, 10.0)
        summary = await asyncio.to_thread(self.manager.summary, exp.name, alpha=alpha, mde=mde)
        return JSONResponse({"experiment": self._describe(exp), "summary": summary})

    async def records(self, request: Request) -> Response:
        exp = self._experiment(request)
        recs = await asyncio.to_thread(self.manager.records, exp.name)
        return JSONResponse({"experiment": exp.to_dict(),
                             "records": [r.to_dict() for r in recs]})

    async def dashboard(self, request: Request) -> Response:
        if self.api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else \
                request.query_params.get("key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise APIError(401, "Missing or invalid API key: open /dashboard?key=KEY or "
                               "send 'Authorization: Bearer <key>'", code="invalid_api_key")
        # The key (if any) stays in the page's address; no-referrer keeps it from leaving.
        return HTMLResponse(self.page, headers={"Cache-Control": "no-store",
                                                "Referrer-Policy": "no-referrer"})


def _level(request: Request, name: str, default: float, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not 0.0 < v <= hi:
        raise APIError(400, f"'{name}' must be a number in (0, {hi:g}]", param=name,
                       code="invalid_value")
    return v


# ---- OpenAPI (server/openapi.py merges these) ------------------------------------------------

_SPEC = {"type": "object", "description": "A speculative object, as a request's "
         "'speculative' field", "additionalProperties": True}
EXPERIMENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["name", "arms"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"},
        "description": {"type": "string"},
        "arms": {"type": "object", "additionalProperties": _SPEC, "minProperties": 2,
                 "maxProperties": 16},
        "control": {"type": "string", "description": "An arm name; default: the first arm"},
        "weights": {"type": "object", "additionalProperties": {"type": "number"},
                    "description": "Positive, per arm (normalised); default: equal"},
        "design": {"type": "string", "enum": ["request", "switchback"]},
        "slot_seconds": {"type": "number", "description": "switchback only; default 300"},
        "burn_in_seconds": {"type": "number", "description": "switchback only; below "
                            "slot_seconds; default 30"},
        "state": {"type": "string", "enum": ["active", "paused", "stopped"]}}}


def _op(method: str, summary: str, codes: tuple[int, ...], body: bool = False,
        media: str = "application/json") -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {media: {"schema": {"type": "object"}}}},
        **{str(c): {"description": str(c), **ref} for c in codes}}}
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/Experiment"}}}}
    return {method: op}


def openapi_paths() -> dict[str, Any]:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    action = {"name": "action", "in": "path", "required": True,
              "schema": {"type": "string", "enum": list(ACTIONS)}}
    return {
        "/v1/experiments": {
            **_op("get", "A/B experiments with their states", (401,)),
            **_op("post", "Create an experiment (201)", (400, 401, 403, 409, 415), body=True)},
        "/v1/experiments/{name}": {"parameters": [name], **_op(
            "get", "Definition and live summary (query alpha, mde)", (400, 401, 404))},
        "/v1/experiments/{name}/records": {"parameters": [name], **_op(
            "get", "Definition and every record", (401, 404))},
        "/v1/experiments/{name}/{action}": {"parameters": [name, action], **_op(
            "post", "Pause, resume or stop (send Content-Type: application/json)",
            (401, 403, 404, 409, 415))},
        "/dashboard": _op("get", "The experiments' live page (?key=KEY or the header)", (401,),
                          media="text/html"),
    }
