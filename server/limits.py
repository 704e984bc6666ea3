"""Per-client limits: how long a request body may take to arrive (`serve --body-timeout`), and
how many requests one client may have in flight (`serve --max-concurrent-per-client`)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from typing import Any

from starlette.responses import JSONResponse

from server.protocol import APIError

BODY_TIMEOUT_S = 30.0


async def read_within(read: Awaitable[bytes], seconds: float | None) -> bytes:
    """The body `read` returns, or a 408 once `seconds` have passed: a client that sends its
    headers and then trickles or stops sending the body holds no handler for long."""
    try:
        return await asyncio.wait_for(read, seconds)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {seconds:g} s (serve "
                       "--body-timeout)", code="request_timeout") from None


class ClientLimit:
    """ASGI middleware: at most `limit` POST requests in flight per client, a request counting
    until its response (streamed or not) has been sent; past that a 429 with Retry-After.

    A client is its API key when the server requires one (`by_key`; only a digest is kept),
    else its address."""

    def __init__(self, app: Any, limit: int, by_key: bool) -> None:
        if limit < 1:
            raise ValueError("--max-concurrent-per-client must be at least 1")
        self.app = app
        self.limit = limit
        self.by_key = by_key
        self.in_flight: dict[str, int] = {}

    def key(self, scope: dict[str, Any]) -> str:
        if self.by_key:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            return "key:" + hashlib.sha256(auth).hexdigest()[:32]
        client = scope.get("client") or ("unknown", 0)
        return f"addr:{client[0]}"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        key = self.key(scope)
        n = self.in_flight.get(key, 0)
        if n >= self.limit:
            err = APIError(429, f"this client has {n} requests in flight, the most this server "
                           "takes (serve --max-concurrent-per-client); retry when one ends",
                           code="too_many_concurrent_requests", headers={"Retry-After": "1"})
            await JSONResponse(err.body(), status_code=429, headers=err.headers)(
                scope, receive, send)
            return
        self.in_flight[key] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[key] - 1
            if left:
                self.in_flight[key] = left
            else:
                del self.in_flight[key]
