"""The server answers while its models load: `/health` is 503 `{"status": "loading"}` with the
stage it is at, every other route a 503 OpenAI error with `Retry-After`, until the engine (and
the default drafter's model) is ready; then every request goes to the real app.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]],
                   Awaitable[None]]


class Progress:
    """What the loader is doing, readable from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.stage = "starting"
        self.done: list[str] = []
        self.error: str | None = None

    def enter(self, stage: str) -> None:
        with self._lock:
            if self.stage != "starting":
                self.done.append(self.stage)
            self.stage = stage

    def fail(self, error: str) -> None:
        with self._lock:
            self.error = error

    def view(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"status": "loading" if self.error is None else "failed",
                                   "stage": self.stage, "done": list(self.done),
                                   "elapsed_s": round(time.monotonic() - self.started, 1)}
            if self.error is not None:
                out["error"] = self.error
            return out


class LoadingApp:
    """An ASGI app that stands in for `inner` until `ready(inner)` is called."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.inner: ASGIApp | None = None

    def ready(self, inner: ASGIApp) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # startup and shutdown are the server's own business
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if self.inner is not None:
            await self.inner(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        view = self.progress.view()
        if scope.get("path") == "/health":
            body = view
        else:
            body = {"error": {"message": f"the server is loading its models ({view['stage']}); "
                              "retry when /health answers 200", "type": "unavailable",
                              "param": None, "code": "loading"}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                                (b"retry-after", b"5")]})
        await send({"type": "http.response.body", "body": data})
