"""OpenAI-compatible HTTP server for the specdec engine."""

from __future__ import annotations

from server.app import build_app
from server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app"]
