"""Fault injection: a request whose drafter or sampler raises fails alone, with a 500 in the
OpenAI error shape (or an error event in its stream), and the requests running beside it finish
with the outputs they have alone. Against a live server (tests/fault_server.py) on a tiny
random model, and against the fake engine in process. The live server also shows that a client
that stops sending its body gets a 408 and holds up nobody."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest_server import FakeEngine, ServerProcess, httpx, make_tiny_model, metric_sum
from conftest_server import metric_values as parse_metrics
from fault_server import POISON_SEED
from test_server_unit import client, run

PROMPTS = [f"# task {i}\ndef f{i}(x):\n    return" for i in range(3)]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    srv = ServerProcess(["--model", str(model), "--served-model-name", "tiny", "--dtype",
                         "float32", "--device", "cpu", "--max-num-seqs", "8", "--speculative",
                         "ngram", "--no-adaptive-speculation", "--body-timeout", "1"],
                        module="tests.fault_server")
    yield from srv.serving(tmp_path_factory.mktemp("logs") / "faults.log")


def complete(srv: ServerProcess, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "speculative": SPEC, **extra}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)


def stream(srv: ServerProcess, prompt: str, **extra: Any) -> list[dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "stream": True, "speculative": SPEC, **extra}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def assert_engine_error(r: httpx.Response) -> None:
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_error" and err["type"] and "injected" in err["message"]


@pytest.mark.parametrize("fault", ["drafter", "sampler"])
def test_a_faulty_request_fails_alone(server: ServerProcess, fault: str) -> None:
    solo = [complete(server, p).json()["choices"][0]["text"] for p in PROMPTS]
    bad: dict[str, Any] = ({"speculative": {**SPEC, "method": "faulty", "fail_at": 20}}
                           if fault == "drafter" else {"seed": POISON_SEED})
    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(complete, server, p) for p in PROMPTS]
        good_stream = pool.submit(stream, server, PROMPTS[0])
        time.sleep(0.2)  # the bad ones join a running batch
        failed = pool.submit(complete, server, "def bad(x):\n    return", **bad)
        failed_stream = pool.submit(stream, server, "def worse(x):\n    return", **bad)
        assert_engine_error(failed.result())
        events = failed_stream.result()
        assert events[-1]["error"]["code"] == "engine_error", events[-1]
        for g, want in zip(goods, solo):
            assert g.result().status_code == 200, g.result().text
            assert g.result().json()["choices"][0]["text"] == want
        chunks = good_stream.result()
        assert "".join(c["choices"][0]["text"] for c in chunks) == solo[0]
    # Nothing is left holding KV blocks, and the server serves on.
    deadline = time.monotonic() + 30
    while True:
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
        if metric_sum(m, "specdec_kv_blocks_used") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metric_sum(m, "specdec_kv_blocks_used") == 0
    assert metric_sum(m, "specdec_requests_finished_total", reason="error") >= 2
    assert complete(server, PROMPTS[1]).json()["choices"][0]["text"] == solo[1]


def test_isolation_with_the_fake_engine() -> None:
    """A step that raises whenever one request runs: that request alone gets a 500."""
    async def go() -> None:
        async with client(FakeEngine(max_num_seqs=8)) as c:
            goods = [asyncio.create_task(c.post("/v1/completions",
                                                json={"prompt": f"ok {i}", "max_tokens": 30}))
                     for i in range(4)]
            await asyncio.sleep(0.02)
            bad = await c.post("/v1/completions", json={"prompt": "POISON", "max_tokens": 3})
            assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
            for g in goods:
                r = await g
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == (
                    FakeEngine.ALPHABET + FakeEngine.ALPHABET[:4])

    run(go())


def test_the_engine_pins_a_drafter_fault(tiny_llama: Path) -> None:
    """In the engine alone: a request whose drafter raises ends with finish reason "error";
    the others of its batch keep the outputs they have alone."""
    from specdec import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), speculative={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7, 5, 6], [9, 9, 9, 9]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    solo = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    bad = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                         speculative={"method": "faulty", "fail_at": 10})
    outs = llm.generate([*prompts, [4, 5, 4, 5]], [greedy] * 3 + [bad])
    assert [o.token_ids for o in outs[:3]] == solo
    assert outs[3].finish_reason == "error" and "injected" in outs[3].error
    assert llm.engine.blocks.num_used == 0


def test_a_stalled_body_is_a_408_and_harms_nobody(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": "he')  # and then nothing more
        assert complete(server, PROMPTS[0]).status_code == 200  # served meanwhile
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408", reply
    assert json.loads(body)["error"]["code"] == "request_timeout"
