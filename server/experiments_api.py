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
import functools
import hmac
import ipaddress
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from experiments.config import (
    DESIGNS,
    MAX_ARMS,
    MAX_SLOT_SECONDS,
    NAME_RE,
    STATES,
    Experiment,
    parse_experiment,
)
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
        # One route per path (and per action), so that another method on a path is a 405 whose
        # Allow header lists all the methods the path takes.
        return [
            Route("/v1/experiments", endpoint("experiments", self.collection, True),
                  methods=["GET", "POST"]),
            Route("/v1/experiments/{name}", endpoint("experiments", self.show, True),
                  methods=["GET"]),
            Route("/v1/experiments/{name}/records", endpoint("experiments", self.records, True),
                  methods=["GET"]),
            *[Route(f"/v1/experiments/{{name}}/{action}",
                    endpoint("experiments", functools.partial(self.act, state=state), True),
                    methods=["POST"]) for action, state in ACTIONS.items()],
            Route("/dashboard", endpoint("dashboard", self.dashboard, False), methods=["GET"]),
        ]

    async def collection(self, request: Request) -> Response:
        return await (self.create(request) if request.method == "POST" else self.index(request))

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

    async def act(self, request: Request, state: str) -> Response:
        await self._write_body(request)
        try:
            exp = await asyncio.to_thread(self.manager.set_state, request.path_params["name"],
                                          state)
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

def experiment_schema(arm: dict[str, Any]) -> dict[str, Any]:
    """An experiment's definition; `arm` is the speculative object an arm runs. What JSON
    Schema (of OpenAPI 3.0) cannot say is in the descriptions: arm names follow the pattern of
    `name`, `control` and the keys of `weights` name arms,
    switchback weights are equal, and `burn_in_seconds` is below `slot_seconds`."""
    name = {"type": "string", "pattern": NAME_RE.pattern}
    positive = {"type": "number", "minimum": 0, "exclusiveMinimum": True}
    switchback_only = {"anyOf": [{"required": ["slot_seconds"]},
                                 {"required": ["burn_in_seconds"]}]}
    return {
        "type": "object", "required": ["name", "arms"], "additionalProperties": False,
        "properties": {
            "name": name,
            "description": {"type": "string", "maxLength": 1000},
            "arms": {"type": "object", "additionalProperties": arm,
                     "minProperties": 2, "maxProperties": MAX_ARMS,
                     "description": "Arm name -> speculation; arm names are spelled as "
                     "experiment names"},
            "control": {"type": "string", "description": "An arm name; default: the first"},
            "weights": {"type": "object", "additionalProperties": positive,
                        "description": "Every arm's share (normalised); default: equal. Under "
                        "switchback all equal"},
            "design": {"type": "string", "enum": list(DESIGNS)},
            "slot_seconds": {"type": "number", "minimum": 1, "maximum": MAX_SLOT_SECONDS,
                             "description": "switchback only; default 300"},
            "burn_in_seconds": {"type": "number", "minimum": 0, "description": "switchback "
                                "only; below slot_seconds; default 30 (or half a slot)"},
            "state": {"type": "string", "enum": list(STATES)},
            "started_at": {"type": "number", "minimum": 0,
                           "description": "Unix seconds; default: when first served"}},
        # slot_seconds and burn_in_seconds only with design: switchback.
        "anyOf": [{"not": switchback_only},
                  {"required": ["design"], "properties": {"design": {"enum": ["switchback"]}}}]}


_REASONS = {400: "Invalid definition or query (the error's param names the field)",
            401: "Missing or wrong API key",
            403: "Without --api-key, writes are taken only from the server's own host",
            404: "No such experiment", 408: "Body not received within --body-timeout",
            409: "Name taken, or a state change the experiment's state rules out",
            413: "Body over the size limit", 415: "Content-Type is not application/json",
            429: "Too many requests in flight from this client (see Retry-After)"}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying",
                                "schema": {"type": "integer"}}}
_RESULT = {"type": "object", "required": ["experiment"],
           "properties": {"experiment": {"type": "object"}}}
_DESCRIBED = {"type": "object", "required": ["name", "arms", "state", "assigning"],
              "properties": {"name": {"type": "string"}, "arms": {"type": "object"},
                             "state": {"type": "string", "enum": list(STATES)},
                             "assigning": {"type": "boolean"}}}
_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"type": "string", "enum": ["list"]},
    "assigning": {"type": "string", "nullable": True},
    "data": {"type": "array", "items": _DESCRIBED}}}


def _op(summary: str, ok: dict[str, Any], codes: tuple[int, ...], auth: bool,
        status: int = 200, media: str = "application/json",
        body: dict[str, Any] | None = None, security: str = "bearer") -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    codes = tuple(sorted(set(codes) | ({401} if auth else set())))
    responses: dict[str, Any] = {str(status): {"description": "OK",
                                               "content": {media: {"schema": ok}}}}
    for c in codes:
        responses[str(c)] = {"description": _REASONS[c], **ref}
        if c == 429:
            responses[str(c)]["headers"] = _RETRY_AFTER
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": body}}}
    if auth:
        op["security"] = [{"bearer": []}] + ([{security: []}] if security != "bearer" else [])
    return op


def openapi_paths(auth: bool) -> dict[str, Any]:
    """The admin API and dashboard as `auth` (the server's --api-key) makes them."""
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    action = {"name": "action", "in": "path", "required": True,
              "schema": {"type": "string", "enum": list(ACTIONS)}}
    level = [{"name": "alpha", "in": "query", "schema": {
                 "type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 0.5,
                 "description": "Significance level; default 0.05"}},
             {"name": "mde", "in": "query", "schema": {
                 "type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 10,
                 "description": "Minimum detectable effect; default 0.05"}}]
    # Writes: 403 only without a key; 408, 413, 415 and 429 from reading the body.
    writes = (408, 413, 415, 429) + (() if auth else (403,))
    create = (400, 409) + writes
    empty = {"type": "object", "description": "Not read: send {} (or an empty body) with "
             "Content-Type: application/json"}
    return {
        "/v1/experiments": {
            "get": _op("A/B experiments with their states", _LIST, (), auth),
            "post": _op("Create an experiment", _DESCRIBED, create, auth, status=201,
                        body={"$ref": "#/components/schemas/Experiment"})},
        "/v1/experiments/{name}": {"parameters": [name], "get": {
            **_op("Definition and live summary", {**_RESULT, "required": [
                "experiment", "summary"]}, (400, 404), auth), "parameters": level}},
        "/v1/experiments/{name}/records": {"parameters": [name], "get": _op(
            "Definition and every record", {**_RESULT, "required": ["experiment", "records"]},
            (404,), auth)},
        "/v1/experiments/{name}/{action}": {"parameters": [name, action], "post": _op(
            "Pause, resume or stop", _DESCRIBED, (400, 404, 409) + writes, auth, body=empty)},
        "/dashboard": {"get": _op("The experiments' live page (the key as ?key=KEY or the "
                                  "header)", {"type": "string"}, (), auth, media="text/html",
                                  security="dashboard_key")},
    }
