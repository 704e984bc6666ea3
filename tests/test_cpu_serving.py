"""The CPU path as a user meets it: `/health` says "loading" until every model of the default
configuration is loaded, the CLI runs on the portable kernels (a CPU with neither AVX-512 nor
bf16), and a CPU-only process neither imports Triton nor prints its exit-time warnings."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server.loading import LoadingApp, Progress


def _call(app, path: str) -> tuple[int, dict]:
    async def go() -> tuple[int, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get(path)
            return r.status_code, r.json()

    return asyncio.run(go())


def test_loading_app_answers_503_until_ready() -> None:
    progress = Progress()
    app = LoadingApp(progress)
    progress.enter("loading qwen2.5-coder-0.5b")
    status, body = _call(app, "/health")
    assert status == 503 and body["status"] == "loading"
    assert body["stage"] == "loading qwen2.5-coder-0.5b"
    status, body = _call(app, "/v1/models")
    assert status == 503 and body["error"]["code"] == "loading"

    async def inner(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}'})

    app.ready(inner)
    assert _call(app, "/health") == (200, {"status": "ok"})


def test_loading_failure_is_reported() -> None:
    progress = Progress()
    progress.fail("FileNotFoundError: no such model")
    status, body = _call(LoadingApp(progress), "/health")
    assert status == 503 and body["status"] == "failed" and "no such model" in body["error"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore")


@pytest.mark.slow
def test_serve_reports_loading_then_serves_on_the_portable_kernels() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", "smollm2-135m", "--port",
         str(port), "--cpu-kernel", "portable", "--speculative", "draft_model", "--draft-model",
         "smollm2-135m"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    seen: list[dict] = []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            assert proc.poll() is None, proc.communicate()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            seen.append(r.json())
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["status"] == "loading"
            time.sleep(0.2)
        assert seen and seen[-1]["status"] == "ok", seen
        stages = {s.get("stage") for s in seen}
        assert any(s and s.startswith("loading") for s in stages), stages
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert "nanobind" not in err and "leaked" not in err, err[-2000:]


@pytest.mark.slow
def test_generate_cli_on_the_portable_kernels_is_quiet() -> None:
    code = ("import runpy, sys; sys.argv = ['specdec', 'generate', '--model', 'smollm2-135m', "
            "'--cpu-kernel', 'portable', '--max-tokens', '6', '--stats', 'def add(a, b):']; "
            "from specdec.cli import main; rc = main(sys.argv[1:]); "
            "print('TRITON', 'triton' in sys.modules, file=sys.stderr); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=_env())
    assert run.returncode == 0, run.stderr
    assert "specdec: ready in" in run.stderr
    assert "TRITON False" in run.stderr
    assert "nanobind" not in run.stderr
    stats = json.loads([line for line in run.stderr.splitlines() if line.startswith("{")][-1])
    assert stats["completion_tokens"] == 6


def test_cli_help_exits_zero_and_shows_defaults() -> None:
    from specdec.cli import main

    assert main(["--help"]) == 0
    from server.cli import build_parser

    text = build_parser().format_help()
    assert "(default: 8000)" in text and "(default: auto)" in text
