"""Live A/B experiments, fast: definitions and their errors, sticky hashing, switchback slots,
and the server's assignment, headers, usage, records, metrics and admin API against the fake
engine in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest_server import FakeEngine, httpx, metric_sum, metric_values
from scipy.stats import binomtest

from experiments.assignment import SwitchbackSchedule, assign_arm
from experiments.config import load_experiments, parse_experiment
from experiments.manager import ExperimentManager
from experiments.store import RecordStore
from server import build_app
from server.experiment_runs import open_experiments

TWO_ARMS = {"none": {"method": "none"}, "ngram": {"method": "ngram",
                                                  "num_speculative_tokens": 3}}


def manager(tmp_path: Path, *defs: dict[str, Any], clock: Any = None) -> ExperimentManager:
    exps = [parse_experiment(d) for d in defs]
    if clock is None:
        return ExperimentManager(RecordStore(tmp_path / "db.sqlite"), exps)
    return ExperimentManager(RecordStore(tmp_path / "db.sqlite"), exps, clock=clock)


# ---- definitions ------------------------------------------------------------------------------

@pytest.mark.parametrize("defn, field", [
    ({"name": "e", "arms": {"none": {"method": "none"}, "ngram": {"method": "ngram",
                                                                  "num_speculative_tokens": 99}}},
     "experiments[0].arms.ngram.num_speculative_tokens"),
    ({"name": "e", "arms": {"none": {"method": "none"}, "ngram": {"method": "ngram", "k": 0.5}}},
     "experiments[0].arms.ngram.k"),
    ({"name": "e", "arms": {"a": {"method": "nope"}, "b": {"method": "none"}}},
     "experiments[0].arms.a.method"),
    ({"name": "e", "arms": {"a": {"method": "ngram", "max_n": "x"}, "b": {"method": "none"}}},
     "experiments[0].arms.a.max_n"),
    ({"name": "e", "arms": {"a": {"method": "none"}}}, "experiments[0].arms"),
    ({"name": "bad name", "arms": TWO_ARMS}, "experiments[0].name"),
    ({"name": "e", "arms": TWO_ARMS, "control": "x"}, "experiments[0].control"),
    ({"name": "e", "arms": TWO_ARMS, "weights": {"none": 1, "ngram": 0}},
     "experiments[0].weights.ngram"),
    ({"name": "e", "arms": TWO_ARMS, "weights": {"none": 1}}, "experiments[0].weights.ngram"),
    ({"name": "e", "arms": TWO_ARMS, "design": "ab"}, "experiments[0].design"),
    ({"name": "e", "arms": TWO_ARMS, "design": "switchback", "slot_seconds": 10,
      "burn_in_seconds": 10}, "experiments[0].burn_in_seconds"),
    ({"name": "e", "arms": TWO_ARMS, "slot_seconds": 10}, "experiments[0].slot_seconds"),
    ({"name": "e", "arms": TWO_ARMS, "state": "on"}, "experiments[0].state"),
    ({"name": "e", "arms": TWO_ARMS, "unit": "user"}, "experiments[0].unit"),
])
def test_bad_experiment_files_name_the_field(tmp_path: Path, defn: dict[str, Any],
                                             field: str) -> None:
    import yaml

    path = tmp_path / "exps.yaml"
    path.write_text(yaml.safe_dump({"experiments": [defn]}))
    with pytest.raises(ValueError) as info:
        load_experiments(path)
    assert str(info.value).startswith(field + ": "), str(info.value)


def test_experiment_files_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "e.yaml").write_text(
        "experiments:\n  - name: k\n    arms:\n      none: {method: none}\n"
        "      ngram: {method: ngram, k: 4}\n"
        "    weights: {none: 1, ngram: 3}\n")
    (tmp_path / "e.json").write_text(json.dumps([{"name": "s", "arms": TWO_ARMS,
                                                  "design": "switchback", "slot_seconds": 60}]))
    (k,) = load_experiments(tmp_path / "e.yaml")
    assert k.control == "none" and k.weights == {"none": 0.25, "ngram": 0.75}
    assert k.arms["ngram"] == {"method": "ngram", "num_speculative_tokens": 4}
    (s,) = load_experiments(tmp_path / "e.json")
    assert (s.design, s.slot_seconds, s.burn_in_seconds) == ("switchback", 60.0, 30.0)
    assert parse_experiment(s.to_dict()) == s
    (tmp_path / "dup.json").write_text(json.dumps([{"name": "s", "arms": TWO_ARMS}] * 2))
    with pytest.raises(ValueError, match=r"^experiments\[1\]\.name: duplicate"):
        load_experiments(tmp_path / "dup.json")
    with pytest.raises(ValueError, match="not valid YAML"):
        (tmp_path / "bad.yaml").write_text("experiments: [\n")
        load_experiments(tmp_path / "bad.yaml")
    # `specdec serve` says so before it loads a model.
    with pytest.raises(ValueError, match=r"experiments\[1\]\.name"):
        open_experiments(str(tmp_path / "dup.json"), str(tmp_path / "db.sqlite"))


# ---- assignment -------------------------------------------------------------------------------

def test_assignment_is_sticky_across_managers(tmp_path: Path) -> None:
    defn = {"name": "sticky", "arms": TWO_ARMS}
    m1 = manager(tmp_path, defn)
    first = {u: m1.assign("r1", user=u).arm for u in (f"user-{i}" for i in range(200))}
    assert {m1.assign("r2", user=u).arm for u in first} <= set(TWO_ARMS)
    assert all(m1.assign(f"other-{i}", user=u).arm == a for i, (u, a) in
               enumerate(first.items()))
    m1.close()
    m2 = manager(tmp_path)  # a restart: the definition comes back from the database
    assert [e.name for e in m2.experiments()] == ["sticky"]
    assert all(m2.assign("r3", key=u).arm == a for u, a in first.items())  # header key alike
    assert len(set(first.values())) == 2
    m2.close()


def test_weight_proportions() -> None:
    """20,000 keys over weights 0.2 / 0.3 / 0.5: each arm's count passes a two-sided binomial
    test at p > 1e-6, so a fair hash fails this with probability under 3e-6 (three tests). The
    hash is deterministic: for these keys the test passes on every run or on none."""
    exp = parse_experiment({"name": "w", "arms": {"a": {"method": "none"},
                                                  "b": {"method": "ngram"},
                                                  "c": {"method": "ngram", "max_n": 2}},
                            "weights": {"a": 2, "b": 3, "c": 5}})
    n = 20_000
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(n):
        counts[assign_arm(exp, f"key-{i}")] += 1
    for arm, w in exp.weights.items():
        assert binomtest(counts[arm], n, w).pvalue > 1e-6, (arm, counts)


def test_switchback_slots_balanced_randomised_deterministic() -> None:
    arms = ("a", "b", "c")
    s = SwitchbackSchedule("exp\x001000.0", arms, 1000.0, 60.0, 10.0)
    slots = [s.arm(i) for i in range(300)]
    for b in range(100):  # every block of len(arms) slots holds each arm once
        assert sorted(slots[3 * b:3 * b + 3]) == list(arms)
    orders = {tuple(slots[3 * b:3 * b + 3]) for b in range(100)}
    assert len(orders) > 1  # not one fixed rotation (all 100 alike: chance (1/6)^99)
    again = SwitchbackSchedule("exp\x001000.0", arms, 1000.0, 60.0, 10.0)
    assert [again.arm(i) for i in range(300)] == slots
    other = SwitchbackSchedule("exp\x002000.0", arms, 2000.0, 60.0, 10.0)
    assert [other.arm(i) for i in range(300)] != slots
    assert (s.slot(1000.0), s.slot(1059.9), s.slot(1060.0), s.slot(999.0)) == (0, 0, 1, 0)
    assert s.in_burn_in(1065.0) and not s.in_burn_in(1070.0)
    assert s.excluded(1, 1065.0, 1080.0)  # started in the burn-in
    assert s.excluded(1, 1075.0, 1121.0)  # ran into the next slot
    assert not s.excluded(1, 1075.0, 1110.0)


def test_switchback_assignment_and_burn_in_records(tmp_path: Path) -> None:
    now = [5000.0]
    m = manager(tmp_path, {"name": "sb", "arms": TWO_ARMS, "design": "switchback",
                           "slot_seconds": 100, "burn_in_seconds": 20}, clock=lambda: now[0])
    sched = SwitchbackSchedule.of(m.get("sb"))
    for t, slot in ((5005.0, 0), (5150.0, 1), (5260.0, 2)):
        now[0] = t
        # Every request of a slot gets the slot's arm, whatever its unit.
        got = {m.assign(f"r{i}", user=f"u{i}").arm for i in range(20)}
        assert got == {sched.arm(slot)} and m.assign("x").slot == slot
    now[0] = 5010.0
    early = m.assign("early")
    now[0] = 5030.0
    clean = m.assign("clean")
    now[0] = 5050.0
    recs = [m.finish(a, request_id=a.unit, prompt_tokens=3, outputs=[], ttft_s=None,
                     tpot_s=None, finish_reason="length") for a in (early, clean)]
    now[0] = 5101.0
    late = m.finish(clean, request_id="late", prompt_tokens=3, outputs=[], ttft_s=None,
                    tpot_s=None, finish_reason="length")
    assert [r.in_burn_in for r in (*recs, late)] == [True, False, True]
    assert m.summary("sb")["excluded_burn_in"] == 2
    m.close()


# ---- the server, in process -------------------------------------------------------------------

@contextlib.asynccontextmanager
async def client(m: ExperimentManager, peer: str = "127.0.0.1",
                 **kw: Any) -> AsyncIterator[Any]:
    app = build_app(FakeEngine(), experiments=m, **kw)
    transport = httpx.ASGITransport(app=app, client=(peer, 1234))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c
    finally:
        await app.state.engine.shutdown(0)
        m.close()


def sse(body: str) -> list[Any]:
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"]


def test_assigned_requests_header_usage_records_metrics(tmp_path: Path) -> None:
    async def go() -> None:
        m = manager(tmp_path, {"name": "exp", "arms": TWO_ARMS})
        async with client(m) as c:
            arms = {}
            for i in range(12):
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                          "user": f"u{i}"})
                arm = r.headers["x-specdec-arm"]
                spec = r.json()["usage"]["speculative"]
                assert arm == f"exp/{spec['arm']}" and spec["experiment"] == "exp"
                assert spec["method"] == ("none" if spec["arm"] == "none" else "ngram")
                arms[f"u{i}"] = spec["arm"]
            assert set(arms.values()) == {"none", "ngram"}
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                "stream": True, "stream_options": {"include_usage": True}, "user": "u1"})
            assert r.headers["x-specdec-arm"] == f"exp/{arms['u1']}"
            assert sse(r.text)[-1]["usage"]["speculative"]["arm"] == arms["u1"]
            r = await c.post("/infill", json={"input_prefix": "a", "input_suffix": "b",
                                              "n_predict": 3},
                             headers={"X-Experiment-Key": "u2"})
            assert r.headers["x-specdec-arm"] == f"exp/{arms['u2']}"
            assert r.json()["speculative"]["arm"] == arms["u2"]
            # A request that chose its own speculation is outside the experiment.
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                      "speculative": {"method": "none"}})
            assert "x-specdec-arm" not in r.headers and r.json()["usage"]["speculative"] is None
            r = await c.get("/v1/experiments/exp/records")
            body = r.json()
            recs = body["records"]
            assert body["experiment"]["name"] == "exp" and len(recs) == 14
            assert {x["unit"]: x["arm"] for x in recs if x["unit"] in arms} == arms
            ngram = [x for x in recs if x["arm"] == "ngram"]
            assert all(x["draft_tokens"] > 0 and x["steps"] > 0 and x["ttft_s"] is not None
                       for x in ngram)
            assert all(x["steps"] == x["output_tokens"] for x in recs if x["arm"] == "none")
            vals = metric_values((await c.get("/metrics")).text)
            n_ngram = metric_sum(vals, "specdec_experiment_requests_total", experiment="exp",
                                 arm="ngram")
            assert n_ngram == len(ngram)
            assert metric_sum(vals, "specdec_experiment_draft_tokens_total", arm="ngram") == \
                sum(x["draft_tokens"] for x in ngram)
            summary = (await c.get("/v1/experiments/exp")).json()["summary"]
            assert summary["arms"]["ngram"]["requests"] == len(ngram)

    asyncio.run(go())


def test_admin_api_auth_errors_and_states(tmp_path: Path) -> None:
    async def go() -> None:
        auth = {"Authorization": "Bearer sekrit"}
        async with client(manager(tmp_path), api_key="sekrit") as c:
            for method, path in (("GET", "/v1/experiments"), ("POST", "/v1/experiments"),
                                 ("GET", "/v1/experiments/x"), ("POST", "/v1/experiments/x/stop"),
                                 ("GET", "/dashboard")):
                r = await c.request(method, path, json={})
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert (await c.get("/dashboard?key=sekrit")).status_code == 200
            bad = {"name": "new", "arms": {"none": {"method": "none"},
                                           "ngram": {"method": "ngram", "min_n": 0}}}
            r = await c.post("/v1/experiments", json=bad, headers=auth)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "arms.ngram.min_n", err
            r = await c.post("/v1/experiments", json={"name": "new", "arms": {
                "none": {"method": "none"}, "d": {"method": "draft_model",
                                                  "draft_model": "/etc/passwd"}}},
                             headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "arms.d.draft_model"
            r = await c.post("/v1/experiments", content=b"name=x", headers=auth)
            assert r.status_code == 415
            r = await c.post("/v1/experiments", json={"name": "new", "arms": TWO_ARMS,
                                                      "state": "paused"}, headers=auth)
            assert r.status_code == 201 and r.json()["state"] == "paused"
            r = await c.post("/v1/experiments", json={"name": "new", "arms": TWO_ARMS},
                             headers=auth)
            assert r.status_code == 409 and r.json()["error"]["code"] == "experiment_exists"
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers=auth)
            assert "x-specdec-arm" not in r.headers  # paused: nothing assigned
            r = await c.post("/v1/experiments/new/resume", json={}, headers=auth)
            assert r.json()["state"] == "active" and r.json()["assigning"]
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                             headers=auth)
            assert r.headers["x-specdec-arm"].startswith("new/")
            listing = (await c.get("/v1/experiments", headers=auth)).json()
            assert listing["assigning"] == "new" and listing["data"][0]["state"] == "active"
            assert (await c.post("/v1/experiments/new/stop", json={},
                                 headers=auth)).json()["state"] == "stopped"
            r = await c.post("/v1/experiments/new/resume", json={}, headers=auth)
            assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
            r = await c.post("/v1/experiments/nope/pause", json={}, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["code"] == "experiment_not_found"
            r = await c.get("/v1/experiments/new?alpha=2", headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "alpha"

    asyncio.run(go())


def test_without_a_key_only_loopback_clients_write(tmp_path: Path) -> None:
    async def go() -> None:
        async with client(manager(tmp_path), peer="10.1.2.3") as c:
            assert (await c.get("/v1/experiments")).status_code == 200
            r = await c.post("/v1/experiments", json={"name": "x", "arms": TWO_ARMS})
            assert r.status_code == 403
        async with client(manager(tmp_path / "local")) as c:
            r = await c.post("/v1/experiments", json={"name": "x", "arms": TWO_ARMS})
            assert r.status_code == 201
            r = await c.post("/v1/experiments/x/pause")  # no Content-Type: a form could do it
            assert r.status_code == 415

    asyncio.run(go())


def test_restart_keeps_states_and_refuses_a_changed_design(tmp_path: Path) -> None:
    defn = {"name": "e", "arms": TWO_ARMS, "control": "none"}
    m = manager(tmp_path, defn)
    started = m.get("e").started_at
    m.set_state("e", "paused")
    m.close()
    m = manager(tmp_path, {**defn, "arms": dict(reversed(TWO_ARMS.items()))})  # order: same
    assert m.get("e").state == "paused" and m.get("e").started_at == started
    m.close()
    with pytest.raises(ValueError, match="differs from the experiment of that name"):
        manager(tmp_path, {**defn, "weights": {"none": 1, "ngram": 2}})


def test_arms_the_server_cannot_run_fail_at_startup(tmp_path: Path) -> None:
    m = manager(tmp_path, {"name": "e", "arms": {"none": {"method": "none"}, "d": {
        "method": "draft_model", "draft_model": "absent"}}})
    with pytest.raises(ValueError, match=r"^experiment 'e': arms\.d\.draft_model: "):
        build_app(FakeEngine(), experiments=m)
    m.close()


def test_one_record_per_request_over_its_choices(tmp_path: Path) -> None:
    async def go() -> None:
        m = manager(tmp_path, {"name": "e", "arms": TWO_ARMS})
        async with client(m) as c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2,
                                                      "user": "u"})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
            (rec,) = (await c.get("/v1/experiments/e/records")).json()["records"]
            assert rec["output_tokens"] == 6 and rec["unit"] == "u"
            assert rec["finish_reason"] == "length" and rec["arm"] == r.json()["usage"][
                "speculative"]["arm"]

    asyncio.run(go())
