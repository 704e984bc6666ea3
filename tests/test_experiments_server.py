"""Experiments on a real `python -m server` process with a tiny random model: headers and usage
on live traffic, the dashboard in headless Chromium showing the JSON API's numbers, and
records and states surviving a SIGKILL and restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from conftest_server import ServerProcess, httpx, make_tiny_model

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXPERIMENTS = """\
experiments:
  - name: drafters
    control: small
    arms:
      none: {method: none}
      small: {method: draft_model, draft_model: other, num_speculative_tokens: 3, p_min: 0}
      self: {method: draft_model, draft_model: self, num_speculative_tokens: 3, p_min: 0}
  - name: later
    arms:
      none: {method: none}
      ngram: {method: ngram}
"""
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                               "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("exp-server")
    model = make_tiny_model(d / "model")
    other = make_tiny_model(d / "other", seed=1)  # another random model: a poor drafter
    (d / "exps.yaml").write_text(EXPERIMENTS)
    args = ["--model", str(model), "--served-model-name", "tiny", "--dtype", "float32",
            "--device", "cpu", "--api-key", KEY, "--speculative", "none",
            "--no-adaptive-speculation", "--draft-models", f"self={model},other={other}",
            "--experiments", str(d / "exps.yaml"), "--experiments-db", str(d / "db.sqlite")]
    state: dict[str, Any] = {"dir": d, "server": ServerProcess(args).start(d / "server.log")}
    try:
        yield state
    finally:
        state["server"].stop()


def complete(srv: ServerProcess, user: str, stream: bool = False) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": PROMPT, "max_tokens": 12, "user": user, "stream": stream,
        "stream_options": {"include_usage": True} if stream else None})


def summary(srv: ServerProcess) -> dict[str, Any]:
    r = httpx.get(srv.url + "/v1/experiments/drafters", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["summary"]


def test_live_traffic_header_and_usage(setup: dict[str, Any]) -> None:
    srv = setup["server"]
    arms = {}
    for i in range(30):
        r = complete(srv, f"user-{i}")
        assert r.status_code == 200, r.text
        spec = r.json()["usage"]["speculative"]
        assert r.headers["x-specdec-arm"] == f"drafters/{spec['arm']}"
        arms[f"user-{i}"] = spec["arm"]
        if spec["arm"] == "self":  # the target drafting for itself: every draft accepted
            assert spec["method"] == "draft_model" and spec["tau"] > 1.0
    assert set(arms.values()) == {"none", "small", "self"}
    r = complete(srv, "user-3", stream=True)
    assert r.headers["x-specdec-arm"] == f"drafters/{arms['user-3']}"
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["usage"]["speculative"]["arm"] == arms["user-3"]
    setup["arms"] = arms


class _Cells(HTMLParser):
    """(experiment, arm, metric or '', field) -> data-value, from the dashboard's DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.exp = self.arm = self.metric = ""
        self.values: dict[tuple[str, str, str, str], Any] = {}
        self.flags: dict[tuple[str, str], Any] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("data-experiment"):
            self.exp = a["data-experiment"] or ""
        elif tag == "tr":
            self.arm, self.metric = a.get("data-arm") or "", a.get("data-metric") or ""
        field, value = a.get("data-field"), a.get("data-value")
        if field and value is not None:
            parsed = json.loads(value) if value else None
            if tag == "td":
                self.values[(self.exp, self.arm, self.metric, field)] = parsed
            else:
                self.flags[(self.exp, field)] = parsed


def chromium(url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--virtual-time-budget=10000", *extra, url],
                          capture_output=True, text=True, timeout=90)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_dashboard_shows_the_json_apis_numbers(setup: dict[str, Any]) -> None:
    srv = setup["server"]
    want = summary(srv)
    url = f"{srv.url}/dashboard?key={KEY}"
    dom = chromium(url, "--dump-dom").stdout
    assert 'data-state="ready"' in dom, dom[-2000:]
    cells = _Cells()
    cells.feed(dom)
    for arm, a in want["arms"].items():
        for field in ("requests", "output_tokens", "draft_tokens", "accepted_tokens"):
            assert cells.values[("drafters", arm, "", field)] == a[field], (arm, field)
        for metric in ("acceptance_rate", "tau"):
            assert cells.values[("drafters", arm, "", metric)] == a[metric]["estimate"]
        for q in ("p50", "p90", "p99"):
            assert cells.values[("drafters", arm, "", f"tpot_{q}")] == \
                a["latency"]["tpot_s"][q]
    for arm, cmp in want["comparisons"].items():
        for metric in ("acceptance_rate", "tau"):
            key = ("drafters", arm, metric, "lift")
            assert cells.values[key] == cmp[metric]["lift"], key
            if cmp[metric]["lift"] is not None:
                assert cells.values[("drafters", arm, metric, "sequential")] == \
                    cmp[metric]["sequential"]
    assert cells.flags[("drafters", "srm")] == want["srm"]["flagged"]
    assert ("later", "none", "", "requests") in cells.values  # every experiment is shown
    shot = setup["dir"] / "dashboard.png"
    chromium(url, "--window-size=1600,1500", f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000
    if os.environ.get("SPECDEC_DASHBOARD_SCREENSHOT"):  # how docs/dashboard.png is made
        shutil.copy(shot, os.environ["SPECDEC_DASHBOARD_SCREENSHOT"])


def test_records_and_states_survive_sigkill(setup: dict[str, Any]) -> None:
    srv: ServerProcess = setup["server"]
    arms = setup.get("arms") or {}
    r = httpx.post(srv.url + "/v1/experiments/later/pause", headers=AUTH, json={})
    assert r.status_code == 200 and r.json()["state"] == "paused"
    r = httpx.post(srv.url + "/v1/experiments", headers=AUTH, json={
        "name": "made-live", "arms": {"a": {"method": "none"}, "b": {"method": "ngram"}}})
    assert r.status_code == 201, r.text
    before = httpx.get(srv.url + "/v1/experiments/drafters/records", headers=AUTH).json()
    assert len(before["records"]) >= len(arms)
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    again = ServerProcess(srv.args)
    setup["server"] = again.start(setup["dir"] / "restart.log")
    after = httpx.get(again.url + "/v1/experiments/drafters/records", headers=AUTH).json()
    assert after["records"] == before["records"]
    states = {e["name"]: e["state"] for e in httpx.get(again.url + "/v1/experiments",
                                                       headers=AUTH).json()["data"]}
    assert states == {"drafters": "active", "later": "paused", "made-live": "active"}
    for user, arm in list(arms.items())[:4]:  # sticky across the restart
        assert complete(again, user).headers["x-specdec-arm"] == f"drafters/{arm}"
    # The records endpoint waits for the appends queued before it.
    n = len(httpx.get(again.url + "/v1/experiments/drafters/records",
                      headers=AUTH).json()["records"])
    assert n == len(before["records"]) + min(4, len(arms))
