"""CORS for the origins the operator allowed (`serve --allowed-origins`), and for no others.

A browser asks before it sends a page's cross-site JSON request (a preflight: OPTIONS with
Access-Control-Request-Method). Only an allowed origin gets the Access-Control-* headers that
let the request go ahead; any other origin's preflight is a 403, and its responses carry no
Access-Control-Allow-Origin, so its page cannot read them.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from server.protocol import APIError

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"
MAX_AGE = "600"


class CORS:
    """ASGI middleware: `origins` are exact origins ("https://app.example:8443") or "*"."""

    def __init__(self, app: Any, origins: list[str]) -> None:
        self.app = app
        self.origins = {o.rstrip("/").lower() for o in origins}

    def allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.lower() in self.origins

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if not origin:  # not a cross-site browser request
            await self.app(scope, receive, send)
            return
        ok = self.allowed(origin)
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            await self._preflight(origin, ok)(scope, receive, send)
            return
        if not ok:
            await self.app(scope, receive, send)
            return

        async def send_with_origin(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[
                    *message.get("headers", []),
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin")])
            await send(message)

        await self.app(scope, receive, send_with_origin)

    @staticmethod
    def _preflight(origin: str, ok: bool) -> Response:
        if not ok:
            err = APIError(403, f"origin {origin!r} is not allowed here (serve "
                           "--allowed-origins)", code="origin_not_allowed")
            return JSONResponse(err.body(), status_code=403, headers={"Vary": "Origin"})
        return Response(status_code=204, headers={
            "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ALLOW_HEADERS, "Access-Control-Max-Age": MAX_AGE,
            "Vary": "Origin"})
