"""End to end: a real `python -m server` process on a loopback port serving a tiny random Qwen2,
driven by the openai client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest_server import ServerProcess, httpx, make_tiny_model, metric_sum, metric_values

MODEL = "tiny"
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
GREEDY = {"temperature": 0.0, "max_tokens": 20}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def servers(tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two servers, started side by side to halve the wait: the main one, and a strict one
    with an API key, one running sequence and a waiting queue of one."""
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", str(tiny_model), "--served-model-name", MODEL, "--dtype", "float32",
              "--device", "cpu"]
    srvs = {
        # Fixed draft lengths: the tests check what speculation does, not when it pays.
        "main": ServerProcess([*common, "--max-num-seqs", "4", "--speculative", "ngram",
                               "--num-speculative-tokens", "3", "--no-adaptive-speculation",
                               "--draft-models", f"self={tiny_model}"]),
        "strict": ServerProcess([*common, "--max-num-seqs", "1", "--max-waiting", "1",
                                 "--api-key", "sekrit", "--speculative", "none"]),
    }
    try:
        for name, srv in srvs.items():
            srv.launch(logs / f"{name}.log")
        for srv in srvs.values():
            srv.wait_healthy()
        yield srvs
    finally:
        codes = {name: srv.stop() for name, srv in srvs.items()}
    assert codes["main"] == 0, srvs["main"].log()


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metrics(srv: ServerProcess) -> dict:
    return metric_values(httpx.get(srv.url + "/metrics").text)


def spec_of(resp: object) -> dict | None:
    return resp.model_dump()["usage"].get("speculative")  # type: ignore[attr-defined]


def test_greedy_equal_across_speculation(client: openai.OpenAI, tiny_model: Path) -> None:
    texts, specs = {}, {}
    for method in ("none", "ngram", "draft_model"):
        spec = {"method": method, "num_speculative_tokens": 3}
        if method == "draft_model":
            spec["draft_model"] = "self"  # the target drafting for itself (--draft-models)
            spec["p_min"] = 0.0  # a tiny random model is never sure of its next token
        r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={
            "speculative": spec}, **GREEDY)
        texts[method], specs[method] = r.choices[0].text, spec_of(r)
        assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"
    assert texts["none"] == texts["ngram"] == texts["draft_model"]
    assert specs["none"] is None
    assert specs["ngram"]["method"] == "ngram" and specs["ngram"]["steps"] >= 1
    draft = specs["draft_model"]
    assert draft["method"] == "draft_model" and draft["tau"] > 1.0
    assert draft["accepted_tokens"] == sum(draft["accepted_per_position"])
    # A chain offers one token per depth: the drafted counts add up to the draft tokens, and
    # no depth accepts more than it was offered.
    assert draft["draft_tokens"] == sum(draft["drafted_per_position"])
    assert all(a <= d for a, d in zip(draft["accepted_per_position"],
                                      draft["drafted_per_position"]))


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    stream = client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 20


def test_chat(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                       max_completion_tokens=12)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                            max_tokens=12, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_fim_completion_and_infill(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.completions.create(model=MODEL, prompt="def add(a, b):\n    ",
                                  suffix="\n\nprint(add(1, 2))\n", **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="def add(a, b):\n    ", **GREEDY)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 3  # FIM tokens and the suffix
    chunks = list(client.completions.create(model=MODEL, prompt="def add(a, b):\n    ",
                                            suffix="\n\nprint(add(1, 2))\n", stream=True,
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    body = httpx.post(server.url + "/infill", json={
        "input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
        "n_predict": 20, "temperature": 0}, timeout=60).json()
    assert body["content"] == r.choices[0].text and body["tokens_predicted"] == 20


def test_concurrent_streams(client: openai.OpenAI) -> None:
    prompts = [f"# task {i}\n{PROMPT}" for i in range(4)]
    expected = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text
                for p in prompts]

    def stream(p: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=p, stream=True, **GREEDY)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(stream, prompts)) == expected


def test_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    before = metric_sum(metrics(server), "specdec_requests_finished_total", reason="abort")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "temperature": 0, "speculative": {"method": "none"}}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    m = wait_aborted(server, before)
    assert metric_sum(m, "specdec_num_requests_running") == 0


def wait_aborted(server: ServerProcess, aborted_before: float) -> dict:
    """Wait for one more aborted request and no KV block in use; return the metrics."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server)
        aborted = metric_sum(m, "specdec_requests_finished_total", reason="abort")
        if aborted > aborted_before and metric_sum(m, "specdec_kv_blocks_used") == 0:
            return m
        time.sleep(0.1)
    pytest.fail(f"request not aborted or blocks not freed: {m}")


def test_superseded_infill_aborts_and_frees_blocks(server: ServerProcess) -> None:
    """An editor drops a non-streamed /infill when the next keystroke supersedes it: the request
    is aborted at the next engine step and its KV blocks are freed."""
    before = metric_sum(metrics(server), "specdec_requests_finished_total", reason="abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/infill", timeout=0.3, json={
            "input_prefix": PROMPT, "input_suffix": "\n", "n_predict": 440, "ignore_eos": True,
            "temperature": 0, "speculative": {"method": "none"}})
    wait_aborted(server, before)


def test_metrics_count_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="x = ", max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=-1)
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("specdec_requests_total", endpoint="completions", status="200") == 2
    assert delta("specdec_requests_total", endpoint="completions", status="400") == 1
    assert delta("specdec_generation_tokens_total") == 6
    assert delta("specdec_time_to_first_token_seconds_count") == 2
    assert delta("specdec_spec_verification_steps_total", method="ngram") >= 2
    assert metric_sum(after, "specdec_kv_blocks_total") > 0


# ---- the strict server: API key, a queue of one, SIGTERM -----------------------------------

@pytest.fixture(scope="module")
def strict_server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["strict"]


def test_error_statuses(strict_server: ServerProcess) -> None:
    url = strict_server.url
    good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x")
    with pytest.raises(openai.NotFoundError) as e404:
        good.completions.create(model="gpt-17", prompt="x")
    assert e404.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e400:
        good.completions.create(model=MODEL, prompt="x", top_p=7)
    assert e400.value.body["param"] == "top_p"
    with pytest.raises(openai.APIStatusError) as e413:
        good.completions.create(model=MODEL, prompt=[11] * 600)
    assert e413.value.status_code == 413
    assert e413.value.body["code"] == "context_length_exceeded"
    auth = {"Authorization": "Bearer sekrit"}
    r = httpx.post(url + "/v1/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers=auth)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"},
                   headers={**auth, "Host": "attacker.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(url + "/v1/engines", headers=auth).status_code == 404

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body,
                                                headers=auth, timeout=120), range(6)))
    codes = sorted(r.status_code for r in rs)
    assert 429 in codes and 200 in codes, codes
    full = next(r for r in rs if r.status_code == 429)
    assert int(full.headers["retry-after"]) >= 1 and full.json()["error"]["code"] == "queue_full"


def test_sigterm_lets_in_flight_requests_finish(strict_server: ServerProcess) -> None:
    result: dict = {}

    def long_request() -> None:
        result["r"] = httpx.post(strict_server.url + "/v1/completions", timeout=120,
                                 headers={"Authorization": "Bearer sekrit"},
                                 json={"model": MODEL, "prompt": PROMPT, "max_tokens": 30,
                                       "temperature": 0})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.5)
    assert strict_server.stop() == 0, strict_server.log()
    t.join(60)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
