"""The server's protocol, streaming, errors and metrics against a fake engine, in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest_server import FakeEngine, httpx, metric_sum, metric_values

from server import build_app


@contextlib.asynccontextmanager
async def client(engine: FakeEngine | None = None, **kw: Any) -> AsyncIterator[Any]:
    app = build_app(engine or FakeEngine(), **kw)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            c.app = app
            yield c
    finally:
        await app.state.engine.shutdown(0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def events(body: str) -> list[Any]:
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_usage_and_speculation() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
            body = r.json()
            assert r.status_code == 200, body
            assert body["object"] == "text_completion"
            assert body["choices"][0]["text"] == "abcde"
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["prompt_tokens"] == 2
            assert body["usage"]["completion_tokens"] == 5
            assert body["usage"]["total_tokens"] == 7
            assert body["usage"]["speculative"] is None
            r = await c.post("/v1/completions", json={
                "prompt": [104, 105], "max_tokens": 6, "speculative": {"method": "ngram"}})
            spec = r.json()["usage"]["speculative"]
            assert r.json()["choices"][0]["text"] == "abcdef"
            assert spec["method"] == "ngram" and spec["steps"] == 3 and spec["tau"] == 2.0
            r = await c.post("/v1/completions", json={"prompt": ["hi"], "stop": ["d"]})
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == ("abc", "stop")

    run(go())


def test_streaming_completion_and_chat() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "stream": True, "echo": True,
                "stream_options": {"include_usage": True}})
            chunks = events(r.text)
            assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == "hiabcd"
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4

            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                "stream": True})
            chunks = events(r.text)
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
            assert text == "abc"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": "s"},
                             {"role": "user", "content": [{"type": "text", "text": "x"}]}],
                "max_completion_tokens": 2, "n": 2, "logprobs": True, "top_logprobs": 2})
            body = r.json()
            assert [ch["index"] for ch in body["choices"]] == [0, 1]
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
            content = body["choices"][0]["logprobs"]["content"]
            assert [e["token"] for e in content] == ["a", "b"]
            assert len(content[0]["top_logprobs"]) == 2
            assert body["usage"]["completion_tokens"] == 4

    run(go())


def test_fim_and_infill() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/completions", json={
                "prompt": "def f(", "suffix": "\n    return x", "max_tokens": 3,
                "logprobs": 1})
            body = r.json()
            assert r.status_code == 200, body
            # 3 FIM tokens around prefix and suffix, one token per character
            assert body["usage"]["prompt_tokens"] == 3 + 6 + 13
            lp = body["choices"][0]["logprobs"]
            assert lp["tokens"] == ["a", "b", "c"] and lp["text_offset"] == [0, 1, 2]

            # A context under llama.cpp's batch of 2048 leaves no room for the repository
            # header (tests/test_infill.py checks the layout in a larger one).
            r = await c.post("/infill", json={"input_prefix": "x = ", "input_suffix": "\n",
                                              "n_predict": 4})
            body = r.json()
            assert r.status_code == 200, body
            assert body["content"] == "abcd" and body["stop_type"] == "limit"
            assert body["tokens_evaluated"] == 3 + 4 + 1

        async with client(FakeEngine(fim=False)) as c:
            r = await c.post("/v1/completions", json={"prompt": "a", "suffix": "b"})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "suffix"
            assert "fill-in-the-middle" in r.json()["error"]["message"]

    run(go())


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "speculative": "fast"}, "speculative"),
    ({"prompt": "x", "speculative": {"num_speculative_tokens": 99}},
     "speculative.num_speculative_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 64}, "max_tokens"),
])
def test_invalid_completion_requests(body: dict[str, Any], param: str) -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param
            assert err["message"]
            # the server is unharmed
            ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200

    run(go())


def test_error_statuses() -> None:
    async def go() -> None:
        async with client(api_key="sekrit") as c:
            auth = {"Authorization": "Bearer sekrit"}
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.post("/v1/completions", json={"prompt": "x"},
                             headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401
            assert (await c.get("/health")).status_code == 200  # probes need no key
            r = await c.post("/v1/completions", content=b"{nope",
                             headers={**auth, "content-type": "application/json"})
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"},
                             headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await c.get("/v1/nothing", headers=auth)
            assert r.status_code == 404 and "error" in r.json()
            r = await c.post("/v1/completions", json={"prompt": "x" * 80}, headers=auth)
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "context_length_exceeded"
            r = await c.post("/v1/chat/completions", json={"messages": []}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = await c.post("/v1/chat/completions", headers=auth,
                             json={"messages": [{"role": "wizard", "content": "x"}]})
            assert r.status_code == 400
            r = await c.post("/v1/completions", headers=auth, json={
                "prompt": "x", "speculative": {"method": "telepathy"}})
            assert r.status_code == 400 and "telepathy" in r.json()["error"]["message"]
            r = await c.get("/v1/models", headers=auth)
            assert r.json()["data"][0]["id"] == "fake-model"

    run(go())


def test_queue_full_gives_429() -> None:
    async def go() -> None:
        engine = FakeEngine(max_num_seqs=1, step_s=0.01)
        async with client(engine, max_waiting=1) as c:
            body = {"prompt": "x", "max_tokens": 40}
            rs = await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(6)])
            codes = sorted(r.status_code for r in rs)
            assert 200 in codes and 429 in codes, codes
            full = next(r for r in rs if r.status_code == 429)
            assert full.headers["retry-after"] and full.json()["error"]["code"] == "queue_full"

    run(go())


def test_failing_request_does_not_hurt_others() -> None:
    async def go() -> None:
        async with client() as c:
            good = asyncio.create_task(c.post("/v1/completions",
                                              json={"prompt": "ok", "max_tokens": 30}))
            await asyncio.sleep(0.02)
            bad = await c.post("/v1/completions", json={"prompt": "POISON", "max_tokens": 3})
            assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
            r = await good
            assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 30
            again = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert again.status_code == 200

    run(go())


def test_metrics_and_openapi() -> None:
    async def go() -> None:
        async with client() as c:
            for spec in ("ngram", "none"):
                await c.post("/v1/completions", json={
                    "prompt": "hi", "max_tokens": 4, "speculative": {"method": spec}})
            await c.post("/v1/completions", json={"prompt": "hi", "top_k": "x"})
            m = metric_values((await c.get("/metrics")).text)
            assert metric_sum(m, "specdec_requests_total", endpoint="completions",
                              status="200") == 2
            assert metric_sum(m, "specdec_requests_total", status="400") == 1
            assert metric_sum(m, "specdec_prompt_tokens_total") == 4
            assert metric_sum(m, "specdec_generation_tokens_total") == 8
            assert metric_sum(m, "specdec_spec_verification_steps_total", method="ngram") == 2
            assert metric_sum(m, "specdec_spec_draft_tokens_total", method="ngram") == 4
            assert metric_sum(m, "specdec_e2e_request_latency_seconds_count") == 2
            assert metric_sum(m, "specdec_kv_blocks_total") == 100
            assert metric_sum(m, "specdec_prefix_cache_hit_rate") == 0.25
            schema = (await c.get("/openapi.json")).json()
            assert schema["openapi"].startswith("3.")
            assert {"/v1/completions", "/v1/chat/completions", "/infill", "/v1/models",
                    "/health", "/metrics"} <= set(schema["paths"])
            props = schema["components"]["schemas"]["Completion"]["properties"]
            assert {"suffix", "speculative", "stream_options"} <= set(props)

    run(go())


def test_the_heap_is_trimmed_when_the_engine_falls_idle(monkeypatch) -> None:
    import server.async_engine as ae

    trims: list[int] = []
    monkeypatch.setattr(ae, "trim_heap", lambda: trims.append(1))

    async def go() -> None:
        async with client() as c:
            for i in range(2):
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
                assert r.status_code == 200
                for _ in range(200):  # the engine thread trims just after the last step
                    if len(trims) > i:
                        break
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)

    run(go())
    assert len(trims) == 2  # once per fall to idle, never while idle
