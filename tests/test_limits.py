"""Per-client limits and browser rules, against the fake engine in process: CORS only for the
allowed origins, concurrent requests per client, a body that does not arrive, and huge prompts
tokenized beside small ones rather than before them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from conftest_server import FakeEngine, FakeTokenizer
from test_server_unit import client, run

GOOD = "https://app.example"
PREFLIGHT = {"origin": GOOD, "access-control-request-method": "POST",
             "access-control-request-headers": "content-type, authorization"}
BODY = {"prompt": "hi", "max_tokens": 2}


def test_cors_only_for_allowed_origins() -> None:
    async def go() -> None:
        async with client(allowed_origins=[GOOD]) as c:
            r = await c.options("/v1/completions", headers=PREFLIGHT)
            assert r.status_code == 204
            assert r.headers["access-control-allow-origin"] == GOOD
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "content-type" in r.headers["access-control-allow-headers"].lower()
            r = await c.post("/v1/completions", json=BODY, headers={"origin": GOOD})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
            evil = {**PREFLIGHT, "origin": "https://evil.example"}
            r = await c.options("/v1/completions", headers=evil)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
            assert "access-control-allow-origin" not in r.headers
            r = await c.post("/v1/completions", json=BODY, headers={"origin": evil["origin"]})
            assert "access-control-allow-origin" not in r.headers
        async with client() as c:  # the default: no origin at all
            r = await c.options("/v1/completions", headers=PREFLIGHT)
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
            r = await c.post("/v1/completions", json=BODY)  # no Origin: not a browser's
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    run(go())


def test_concurrent_requests_per_client() -> None:
    async def go(**kw: Any) -> None:
        headers = {"authorization": "Bearer k"} if kw.get("api_key") else {}
        async with client(FakeEngine(step_s=0.01), max_concurrent_per_client=2, **kw) as c:
            body = {"prompt": "x", "max_tokens": 20}
            rs = await asyncio.gather(*[c.post("/v1/completions", json=body, headers=headers)
                                        for _ in range(5)])
            codes = sorted(r.status_code for r in rs)
            assert codes.count(200) >= 2 and 429 in codes, codes
            over = next(r for r in rs if r.status_code == 429)
            assert over.headers["retry-after"] == "1"
            assert over.json()["error"]["code"] == "too_many_concurrent_requests"
            assert over.json()["error"]["type"] == "rate_limit_error"
            assert c.app.state.engine.num_in_flight == 0
            r = await c.post("/v1/completions", json=body, headers=headers)  # slots came back
            assert r.status_code == 200
            assert (await c.get("/health")).status_code == 200

    run(go())
    run(go(api_key="k"))


def test_a_body_that_stops_coming_is_a_408() -> None:
    gate = asyncio.Event()

    async def trickle() -> Any:
        yield b'{"prompt": "hel'
        await gate.wait()  # the client stops sending
        yield b'lo"}'

    async def go() -> None:
        async with client(body_timeout=0.2) as c:
            r = await c.post("/v1/completions", content=trickle(),
                             headers={"content-type": "application/json"})
            gate.set()
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
            r = await c.post("/v1/completions", json=BODY)  # the server is unaffected
            assert r.status_code == 200

    run(go())


class GatedTokenizer(FakeTokenizer):
    """Holds a big text's tokenizing until the test opens the gate."""

    entered = threading.Event()
    gate = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 1000:
            GatedTokenizer.entered.set()
            GatedTokenizer.gate.wait(60)
        return super().encode(text, add_special_tokens)


def test_a_small_prompt_is_not_tokenized_behind_a_huge_one() -> None:
    async def go() -> None:
        engine = FakeEngine()
        engine.tokenizer = GatedTokenizer()
        async with client(engine) as c:
            big = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": "x" * (1 << 17), "max_tokens": 2}))
            await asyncio.to_thread(GatedTokenizer.entered.wait, 30)
            # Still tokenizing the huge prompt: the small one is answered meanwhile.
            small = await asyncio.wait_for(c.post("/v1/completions", json=BODY), 30)
            assert not big.done()
            GatedTokenizer.gate.set()
            assert small.status_code == 200
            assert (await big).status_code == 413  # far longer than the fake's context

    try:
        run(go())
    finally:
        GatedTokenizer.gate.set()


def test_cli_limit_defaults() -> None:
    from server.cli import build_parser, split_list
    from server.limits import BODY_TIMEOUT_S

    args = build_parser().parse_args([])
    assert (args.body_timeout, args.max_concurrent_per_client) == (BODY_TIMEOUT_S, None)
    assert split_list(args.allowed_origins) == []
    args = build_parser().parse_args(["--allowed-origins", "https://a.example, http://b:3000",
                                      "--max-concurrent-per-client", "4"])
    assert split_list(args.allowed_origins) == ["https://a.example", "http://b:3000"]
    assert args.max_concurrent_per_client == 4
